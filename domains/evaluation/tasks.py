"""Registry entries of the evaluation domain: handlers and hooks by module path, payload models."""

from typing import Any

from domains.evaluation.payloads import GeneratePayload, RunPayload
from tasks_core.registry import TaskSpec

GENERATE = "evaluation.generate_dataset"
RUN = "evaluation.run"
# Both are made by the /evaluation routes with the dataset or run row they fill.
_DATASET_HOOKS: dict[str, Any] = {
    "on_success": "domains.evaluation.hooks:dataset_success",
    "on_failure": "domains.evaluation.hooks:dataset_failure",
    "internal": True,
}
_RUN_HOOKS: dict[str, Any] = {
    "on_success": "domains.evaluation.hooks:run_success",
    "on_failure": "domains.evaluation.hooks:run_failure",
    "internal": True,
}

SPECS = (
    # Not retry-safe by declaration: a lost generation ends `failed` with its items kept, and the
    # user resumes it (POST /evaluation/datasets/{id}/resume) from the persisted count.
    TaskSpec(
        GENERATE,
        "domains.evaluation.handlers:generate_dataset",
        timeout_seconds=6 * 3600,
        payload=GeneratePayload,
        **_DATASET_HOOKS,
    ),
    TaskSpec(
        RUN, "domains.evaluation.handlers:run", timeout_seconds=6 * 3600, payload=RunPayload, **_RUN_HOOKS
    ),
)
