"""The knowledge domain's declaration: how the runtime, the api, Alembic and `dtask` find its parts."""

from pathlib import Path

from tasks_core.domain import Domain

DOMAIN = Domain(
    name="knowledge",
    root=Path(__file__).resolve().parent,
    tasks=("domains.knowledge.tasks",),
    cli=("kb", "domains.knowledge.cli:cli"),
    api="domains.knowledge.routes:api_router",
    api_errors={
        "domains.knowledge.errors:StoreError": "domains.knowledge.routes:unavailable",
        "domains.knowledge.errors:StoresNotConfigured": "domains.knowledge.routes:unavailable",
    },
    ui="domains.knowledge.routes_ui:UI",
    metadata="domains.knowledge.model",
    settings=(
        "domains.knowledge.settings:KnowledgeSettings",
        "domains.knowledge.model_settings:EmbeddingSettings",
        "domains.knowledge.grouping:GroupingSettings",
    ),
    readiness={
        "milvus": "domains.knowledge.routes:milvus_ready",
        "object_store": "domains.knowledge.routes:object_store_ready",
    },
    path_limits="domains.knowledge.routes:body_routes",
    metrics=(
        "domains.knowledge.model_metrics:EMBEDDING_RETRIES",
        "domains.knowledge.model_metrics:EMBEDDING_FAILURES",
    ),
)
