"""The Hugging Face Hub, asked once per model before anything is loaded (one HEAD request for config.json, without
retries), so that each way it can fail is one line naming the model and the fix, and fails at once; a model in the
local cache behind an unreachable Hub switches the process to offline mode. Why: docs/troubleshooting.md, "Models
from the Hugging Face Hub, with or without network"."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from tunekit.config.schema import DATA_SUFFIXES
from tunekit.core.errors import TunekitError, first_line

log = logging.getLogger("tunekit")

PROBE_TIMEOUT_S = 10.0


class Unavailable(TunekitError):
    """The model exists as far as can be told, but cannot be had from here now: offline, Hub
    unreachable, or gated. Commands that need only its config may fall back (see modelinfo)."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why  # a few words: "not in the local cache and HF_HUB_OFFLINE=1"


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def go_offline() -> None:
    """Offline mode for this process and the processes it starts (huggingface_hub and datasets read
    the environment once, at import, so their flags are set too)."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True


def _cached(repo: str, revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo, "config.json", revision=revision), str)


def local_file(spec: str, revision: str | None, name: str) -> Path | None:
    """A file of a model or tokenizer that is here: in its local directory, or in the Hugging Face cache (never
    downloaded); None otherwise (a GGUF file, a hub model not cached)."""
    from tunekit.config.modelsource import resolve_model

    try:
        source = resolve_model(spec)
    except TunekitError:
        return None
    if source.kind == "dir":
        path = Path(source.location) / name
        return path if path.is_file() else None
    if source.kind == "hub":
        from huggingface_hub import try_to_load_from_cache

        try:
            path = try_to_load_from_cache(spec, name, revision=revision)
        except ValueError:  # not a valid repo id
            return None
        return Path(path) if isinstance(path, str) else None
    return None


def _get(key: str, repo: str) -> str:
    return (f"download it where the Hub is reachable (`hf download {repo}`) and copy the Hugging Face cache "
            f"(HF_HOME) here, or set {key} to a local model directory")


def _login(repo: str) -> str:
    return (f"accept its terms on https://huggingface.co/{repo} with your account, then log in here "
            f"(`hf auth login`, or set HF_TOKEN)")


_checked: dict[tuple, TunekitError | None] = {}


def require(repo: str, revision: str | None = None, key: str = "model.name_or_path") -> None:
    """Check that hub model `repo` can be loaded; raise a one-line TunekitError saying why not
    (Unavailable where the model is not known to be wrong). Asked once per process."""
    if (repo, revision, key) not in _checked:
        try:
            _probe(repo, revision, key)
            _checked[repo, revision, key] = None
        except TunekitError as e:
            _checked[repo, revision, key] = e
    if (failure := _checked[repo, revision, key]) is not None:
        raise failure


def _probe(repo: str, revision: str | None, key: str) -> None:
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    if offline():
        if _cached(repo, revision):
            return
        raise Unavailable(f"{key}: {repo!r}{at} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 "
                           f"forbids downloading it; {_get(key, repo)}", "not in the local cache and HF_HUB_OFFLINE=1")
    try:
        get_hf_file_metadata(hf_hub_url(repo, "config.json", revision=revision), timeout=PROBE_TIMEOUT_S)
        return
    except HFValidationError:
        raise TunekitError(f"{key}: {repo!r} is neither a local path nor a valid hub id (owner/name); "
                           f"check the spelling") from None
    except GatedRepoError:  # before RepositoryNotFoundError, its parent class
        raise Unavailable(f"{key}: {repo!r} is a gated model and this machine is not allowed to download it; "
                           f"{_login(repo)}", "gated, and this machine is not logged in with access") from None
    except RepositoryNotFoundError:
        raise TunekitError(f"{key}: no model {repo!r} on the Hub ({constants.ENDPOINT}), or it is private; check "
                           f"the name, or log in with an account that can see it (`hf auth login`, or set HF_TOKEN)"
                           ) from None
    except RevisionNotFoundError:
        raise TunekitError(f"model.revision: {repo!r} has no revision {revision!r} (a branch, tag or commit); "
                           f"check it, or remove model.revision for the default branch") from None
    except RemoteEntryNotFoundError:
        raise TunekitError(f"{key}: {repo!r}{at} has no config.json, so it is not a transformers model; "
                           f"point {key} at a model repository or directory") from None
    except HfHubHTTPError as e:  # a rejected token, a Hub server error (5xx), a proxy refusing
        if getattr(e.response, "status_code", None) == 401:
            raise TunekitError(f"{key}: the Hub rejected this machine's token while fetching {repo!r}; log in again "
                               f"(`hf auth login`, or set HF_TOKEN to a valid token)") from None
        reason = network_reason(e)
    except Exception as e:  # no network, DNS failure, timeout: raised by whichever HTTP client
        reason = network_reason(e)  # huggingface_hub uses (httpx, httpx2 or requests, by version)
    if _cached(repo, revision):
        log.info("the Hugging Face Hub is not reachable (%s); using the cached copy of %s, offline", reason, repo)
        go_offline()
        return
    raise Unavailable(f"{key}: cannot reach the Hugging Face Hub ({constants.ENDPOINT}: {reason}) to download "
                       f"{repo!r}{at}; {_get(key, repo)}", f"the Hub is not reachable: {reason}")


def probe_dataset(repo: str, key: str | None = None) -> None:
    """Before `datasets` reads hub data set `repo`: one request without retries; when it shows the Hub
    cannot be reached, go offline, so that `datasets` reads its cache or fails at once. With `key` (the
    recipe key naming it), a data set that cannot be had here, offline and not in the datasets cache,
    raises Unavailable. Imports no `datasets`."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    why = "HF_HUB_OFFLINE=1"
    if not offline():
        try:
            get_hf_file_metadata(hf_hub_url(repo, "README.md", repo_type="dataset"), timeout=PROBE_TIMEOUT_S)
            return
        except (HfHubHTTPError, HFValidationError):
            return  # the Hub answered: `datasets` reports what it said
        except Exception as e:  # no network (see _probe)
            why = f"the Hub is not reachable: {network_reason(e)}"
            go_offline()
    cached = _dataset_cached(repo)
    if key is not None and not cached:
        raise Unavailable(f"{key}: data set {repo!r} is not in the local datasets cache and the Hub cannot be used "
                          f"here ({why}); load it once where the Hub is reachable and copy the cache (HF_HOME), "
                          f"or set {key} to a local {'/'.join(DATA_SUFFIXES)} file",
                          f"not in the local datasets cache, and {why}")
    if why != "HF_HUB_OFFLINE=1":
        log.info("the Hugging Face Hub is not reachable (%s); reading data set %s from the local cache",
                 why.removeprefix("the Hub is not reachable: "), repo)


def _dataset_cached(repo: str) -> bool:
    """Whether `datasets` holds a prepared copy of hub data set `repo`, where it looks when offline:
    HF_DATASETS_CACHE/OWNER___NAME (the name in snake case)/CONFIG/VERSION/HASH."""
    if "datasets" in sys.modules:
        root = Path(sys.modules["datasets"].config.HF_DATASETS_CACHE)
    else:  # datasets.config's defaults
        home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
        root = Path(os.environ.get("HF_DATASETS_CACHE") or os.path.join(home, "datasets")).expanduser()
    parts = repo.split("/")
    parts[-1] = re.sub(r"([a-z\d])([A-Z])", r"\1_\2", re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", parts[-1])).lower()
    return any(p.is_dir() for p in (root / "___".join(parts)).glob("*/*/*"))


def config_file(repo: str, revision: str | None, key: str = "model.name_or_path") -> str:
    """The local path of hub model `repo`'s config.json (from the cache, or downloaded); call `require` first."""
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo, "config.json", revision=revision)
    except Exception as e:  # a partial cache offline, a broken download
        raise load_error(key, repo, e) from None


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and those it was raised from, outermost first."""
    found = [exc]
    while (exc := exc.__cause__ or exc.__context__) is not None and exc not in found:
        found.append(exc)
    return found


def network_reason(exc: BaseException) -> str:
    """The innermost message of a network error: 'Name or service not known', 'Connection refused'."""
    return first_line(_chain(exc)[-1]).removeprefix("[Errno -2] ").removeprefix("[Errno 111] ")[:120]


def load_error(key: str, spec: str, exc: Exception) -> TunekitError:
    """A one-line error for a failed from_pretrained of `spec` after `require` passed (a file the
    cache lacks while offline, a broken download, an incompatible checkpoint)."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    if any(isinstance(e, LocalEntryNotFoundError) for e in _chain(exc)):
        return TunekitError(f"{key}: {spec!r} is only partly in the local Hugging Face cache and the Hub cannot be "
                            f"used; {_get(key, spec)}")
    return TunekitError(f"{key}: cannot load {spec!r} ({first_line(exc)[:200]})")
