"""The graph domain's declaration: how the runtime, the api and Alembic find its parts."""

from pathlib import Path

from tasks_core.domain import Domain

DOMAIN = Domain(
    name="graph",
    root=Path(__file__).resolve().parent,
    tasks=("domains.graph.tasks",),
    api="domains.graph.routes:router",
    ui="domains.graph.routes_ui:UI",
    metadata="domains.graph.model",
    settings=("domains.graph.settings:GraphSettings", "domains.graph.llm_extractor:LLMExtractorSettings"),
)
