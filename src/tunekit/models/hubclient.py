"""The Hugging Face Hub as `tunekit push` writes to it: the token, the repo id, and the calls an upload makes, each
failure one line naming what is wrong and what to do (reading models from the Hub: models.hub)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from tunekit.core.errors import TunekitError, first_line

log = logging.getLogger("tunekit")

TOKEN_FIX = ("set HF_TOKEN to a write token (https://huggingface.co/settings/tokens) or log in with "
             "`hf auth login`")

REPO_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?")


def check_repo_id(repo: str, flag: str = "--repo") -> str:
    """OWNER/NAME as the Hub takes it: letters, digits, '-', '_', '.', neither '--' nor '..', at most 96 each."""
    parts = repo.split("/")
    if len(parts) != 2 or not all(REPO_PART.fullmatch(p) and len(p) <= 96 and "--" not in p and ".." not in p
                                  for p in parts):
        raise TunekitError(f"{flag} {repo}: give OWNER/NAME, e.g. alice/smollm2-sft (letters, digits, '-', '_' and "
                           "'.'; no '--' or '..')")
    return repo


def token() -> str:
    """The token huggingface_hub would use (HF_TOKEN, else the one `hf auth login` stored), checked present."""
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise TunekitError("HF_HUB_OFFLINE=1 forbids uploading to the Hugging Face Hub; unset it to push")
    found = get_token()
    if not found:
        raise TunekitError(f"no Hugging Face token here: {TOKEN_FIX}")
    return found


class Hub:
    """The calls push makes, each failure one line naming what is wrong and what to do."""

    def __init__(self, token: str, repo: str):
        from huggingface_hub import HfApi, constants
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # one line per step here, and an error stays one line
        self.api, self.repo, self.endpoint = HfApi(token=token), repo, constants.ENDPOINT

    def error(self, doing: str, exc: Exception) -> TunekitError:
        from tunekit.models.hub import network_reason

        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status == 401:
            return TunekitError(f"the Hugging Face Hub rejected the token (401 while {doing}); {TOKEN_FIX}")
        if status == 403:
            return TunekitError(f"the token here may not write to {self.repo} (403 while {doing}); use a write token "
                                f"of {self.repo.split('/')[0]} or of a member of it")
        if status is not None:
            return TunekitError(f"the Hugging Face Hub answered {status} while {doing} ({first_line(exc)[:160]}); "
                                "run the command again later")
        return TunekitError(f"cannot reach the Hugging Face Hub at {self.endpoint} while {doing} "
                            f"({network_reason(exc)}); check the network (and HF_ENDPOINT), then run the command again")

    def call(self, doing: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise self.error(doing, e) from None

    def info(self, repo: str, revision: str | None = None):
        """The model repo's info (its files at `revision`), or None where it does not exist."""
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            return self.api.model_info(repo, revision=revision)
        except RepositoryNotFoundError:
            return None
        except Exception as e:
            raise self.error(f"looking up {repo}", e) from None

    def check(self, private: bool, force: bool) -> bool:
        """The token is valid and may write to the repo's owner; the repo is new, or --force. Whether it exists."""
        who = self.call("checking the token", self.api.whoami)
        if ((who.get("auth") or {}).get("accessToken") or {}).get("role") == "read":
            raise TunekitError(f"the Hugging Face token here is read-only; {TOKEN_FIX} (with write access)")
        owner, user = self.repo.split("/")[0], who.get("name")
        if owner not in [user] + [o.get("name") for o in who.get("orgs") or []]:
            raise TunekitError(f"--repo {self.repo}: the token here is {user}'s, who is not {owner} nor a member of "
                               f"it; push to {user}/NAME, or use a token of {owner}")
        info = self.info(self.repo)
        if info is None:
            return False
        empty = not {s.rfilename for s in info.siblings or []} - {".gitattributes"}
        if empty:  # as create_repo leaves it (or an upload that was interrupted): nothing in it to replace
            log.info("%s exists and is empty: pushing into it", self.repo)
        elif not force:
            raise TunekitError(f"--repo {self.repo}: already exists on the Hub ({self.endpoint}/{self.repo}); pass "
                               "--force to replace its files with this upload (one commit), or give another --repo")
        if private and not info.private:
            raise TunekitError(f"--private: {self.repo} exists and is public; make it private on the Hub first (its "
                               "settings page), or push without --private")
        return True

    def license_of(self, model: str) -> str | None:
        """A hub model's license as its card states it; None where it cannot be had."""
        try:
            data = self.api.model_info(model).card_data
            return data.get("license") if data else None
        except Exception:
            return None

    def commit(self, files: dict[str, Path | bytes], exists: bool, private: bool, revision: str | None,
               message: str) -> str:
        """Create the repo (and branch) where needed, then one commit: every file, and with --force the deletion
        of the files this upload does not have. The Hub applies a commit whole or not at all."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        if not exists:
            self.call(f"creating {self.repo}", self.api.create_repo, self.repo, private=private)
        if revision and revision != "main":
            self.call(f"creating branch {revision}", self.api.create_branch, self.repo, branch=revision, exist_ok=True)
        remote = self.info(self.repo, revision) if exists else None
        stale = (sorted({s.rfilename for s in (remote.siblings or [])} - set(files) - {".gitattributes"}) if remote
                 else [])
        operations = [CommitOperationAdd(path_in_repo=k, path_or_fileobj=str(v) if isinstance(v, Path) else v)
                      for k, v in files.items()] + [CommitOperationDelete(path_in_repo=p) for p in stale]
        try:
            return self.api.create_commit(self.repo, operations=operations, commit_message=message,
                                          revision=revision).commit_url
        except Exception as e:
            from tunekit.models.hub import network_reason

            status = getattr(getattr(e, "response", None), "status_code", None)
            if status in (401, 403):
                raise self.error("uploading", e) from None
            why = f"the Hub answered {status}" if status is not None else network_reason(e)
            raise TunekitError(f"upload to {self.repo} interrupted ({why}); the repo holds none of it (the upload is "
                               "one commit, not made): run the same command again") from None
