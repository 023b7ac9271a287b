"""Where `--model` is: a local path as it is, else a Hugging Face hub id fetched into (or found in)
the HF cache — only the files aserve reads (`HUB_FILES`). A name that is neither is
`ModelNotFound`, one line for the CLI (exit code 2)."""

from __future__ import annotations

from pathlib import Path

HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]


class ModelNotFound(Exception):
    """No such directory or file, nor a hub repository that can be fetched."""


def resolve_model(name: str) -> str:
    """A local directory as is; else a hub id, fetched into (or found in) the HF cache."""
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return snapshot_download(name, allow_patterns=HUB_FILES)
    except HFValidationError:
        raise ModelNotFound(f"model {name!r}: no such directory (nor a hub id org/name)") from None
    except LocalEntryNotFoundError:
        raise ModelNotFound(f"model {name!r}: no such directory, and no copy in the Hugging Face "
                         "cache (HF_HUB_OFFLINE is set or the hub is unreachable)") from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise ModelNotFound(f"model {name!r}: no such directory, nor a hub repository you can "
                         "read (private or gated ones need HF_TOKEN)") from None
    except Exception as e:  # noqa: BLE001 - any download failure is one line, not a traceback
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise ModelNotFound(f"model {name!r}: download failed: {type(e).__name__}: "
                         f"{first_line}") from None
