"""The evaluation domain's declaration: how the runtime, the api and Alembic find its parts."""

from pathlib import Path

from tasks_core.domain import Domain

DOMAIN = Domain(
    name="evaluation",
    root=Path(__file__).resolve().parent,
    tasks=("domains.evaluation.tasks",),
    api="domains.evaluation.routes:router",
    ui="domains.evaluation.routes_ui:UI",
    metadata="domains.evaluation.model",
    settings=(
        "domains.evaluation.settings:EvaluationSettings",
        "domains.evaluation.llm_generator:LLMGeneratorSettings",
        "domains.llm_client:LLMSettings",
    ),
)
