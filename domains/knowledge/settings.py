"""The knowledge domain's own settings (environment ``DTASK_*``, also read from ``.env``).

Their variables keep the names they had when the runtime's ``Settings`` held them. The stores'
addresses (DTASK_MILVUS_URI, DTASK_MINIO_*) stay there: ``dtask dev`` starts and reports them as the
system's services.
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class KnowledgeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DTASK_", env_file=".env", extra="ignore")

    # Characters of text one file may give; over it the file ends error_parsing naming this
    # setting. The upload limit does not bound text: a PDF's font map can turn each byte into
    # hundreds of characters. Higher admits longer books; every character is chunked, embedded
    # and stored. 4,000,000 is about 1,500 pages of prose and 5,000 to 10,000 chunks.
    knowledge_max_chars: int = Field(default=4_000_000, ge=1)
    # Chunks one file may give (each is embedded, upserted to Milvus and stored in PostgreSQL):
    # bounds one file's indexing work whatever the character limit; over it, error_parsing.
    knowledge_max_chunks: int = Field(default=10_000, ge=1)
    # Address space of the process that parses and chunks a file (its own child of the worker
    # process, reused across files). A file that needs more ends error_parsing; higher lets
    # heavier PDFs through, but every worker process may hold this much more while it parses.
    knowledge_parse_memory_mb: int = Field(default=512, ge=64)
    # Wall-clock time one file's parse may take (also its CPU limit) before the parser is killed
    # and the file ends error_parsing. Longer admits slower PDFs; a hostile one holds a task slot
    # and a core this long.
    knowledge_parse_seconds: float = Field(default=120.0, gt=0, allow_inf_nan=False)


@lru_cache(maxsize=1)
def get_knowledge_settings() -> KnowledgeSettings:
    """The process's knowledge settings, read once (a test changing the environment clears this cache)."""
    return KnowledgeSettings()
