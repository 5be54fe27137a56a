"""A small client for the /v1/ API, used by the `kiln` command (standard library only).

The server URL and token come from KILN_URL and KILN_TOKEN, else from the config file
$XDG_CONFIG_HOME/kiln/cli.json (default ~/.config/kiln/cli.json): {"url": ..., "token": ...}.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8000"


class _Redirected(Exception):
    def __init__(self, status: int, location: str):
        super().__init__(location)
        self.status, self.location = status, location


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """The API never redirects. Following one would send the bearer token wherever the answer points (urllib
    copies the Authorization header to another host) and turn a POST into a GET, so the client stops instead."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise _Redirected(code, newurl)


_OPENER = urllib.request.build_opener(_NoRedirects)


class ApiError(Exception):
    """A refusal from the server (status, code, message, the whole error object) or no answer at all."""

    def __init__(self, status: int | None, error: dict):
        self.status, self.error = status, error
        self.code = error.get("code", "error")
        self.message = error.get("message", "")
        super().__init__(f"{self.code}: {self.message}")


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kiln" / "cli.json"


def load_config() -> tuple[str, str | None]:
    """(url, token): the environment first, then the config file."""
    stored: dict = {}
    path = config_path()
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ApiError(None, {"code": "config_unreadable", "message": f"{path} cannot be read as JSON: {exc}"})
        if not isinstance(stored, dict):
            raise ApiError(None, {"code": "config_unreadable", "message": f"{path} must hold a JSON object"})
    url = os.environ.get("KILN_URL") or stored.get("url") or DEFAULT_URL
    token = os.environ.get("KILN_TOKEN") or stored.get("token")
    where = "KILN_URL=" if os.environ.get("KILN_URL") else f"\"url\" in {path} " if stored.get("url") else ""
    check_url(url, where)
    return url.rstrip("/"), token


def check_url(url, where: str = "KILN_URL=") -> None:
    """Refuse a server URL urllib cannot use (no http(s) scheme, no host, a port that is no number), naming WHERE it
    was set, before any request turns it into a traceback or a misleading "cannot reach"."""
    try:
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        usable = parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname)
        usable = usable and (parts.port or 0) >= 0  # .port raises ValueError on a port that is no number
    except ValueError:
        usable = False
    if not usable:
        shown = f"{where}{url!r}" if where.endswith("=") else f"{where}({url!r})"
        raise ApiError(None, {"code": "invalid_url", "message": f"{shown} is not an http:// or https:// URL; set it "
                              f"to the root of a Kiln server, e.g. {DEFAULT_URL}"})


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 300.0):
        configured_url, configured_token = load_config() if url is None or token is None else (url, token)
        self.url = (url or configured_url).rstrip("/")
        self.token = token or configured_token
        self.timeout = timeout

    def request(self, method: str, path: str, body: dict | None = None, query: dict | None = None) -> dict:
        if not self.token:
            raise ApiError(None, {"code": "no_token", "message": "no API token: set KILN_TOKEN (or \"token\" in "
                                  f"{config_path()}); create one with: kiln token create --user NAME"})
        url = f"{self.url}/v1{path}"
        if query:
            url += "?" + urllib.parse.urlencode({key: value for key, value in query.items() if value is not None})
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with _OPENER.open(request, timeout=self.timeout) as response:
                raw = response.read()
                try:
                    document = json.loads(raw or b"{}")
                except ValueError:
                    document = None
                if not isinstance(document, dict):
                    raise ApiError(response.status, {"code": "not_kiln", "message": self._not_kiln(
                        method, path, response.status, response.headers, raw)})
                return document
        except _Redirected as exc:
            raise ApiError(exc.status, {"code": "redirected", "message": (
                f"{url} answered {exc.status} with a redirect to {exc.location}; Kiln's API never redirects, so the "
                "token was not sent there. If that address is your Kiln server, set KILN_URL to it (without /v1/...)")}
            ) from None
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                error = json.loads(raw)["error"]
                if not isinstance(error, dict):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                error = {"code": f"http_{exc.code}",
                         "message": self._not_kiln(method, path, exc.code, exc.headers, raw)}
            raise ApiError(exc.code, error) from None
        except http.client.HTTPException as exc:  # an answer that is no HTTP (BadStatusLine: Redis' port, say)
            raise ApiError(None, {"code": "unreachable", "message": f"{self.url} did not answer in HTTP "
                                  f"({type(exc).__name__}: {str(exc)[:80]}); check KILN_URL: it is the address "
                                  "`kiln up` prints (\"Kiln is serving at ...\")"}) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ApiError(None, {"code": "unreachable", "message": f"cannot reach Kiln at {self.url} ({reason}); "
                                  "is `kiln up` running there? set KILN_URL to its address"}) from None

    def _not_kiln(self, method: str, path: str, status: int, headers, raw: bytes) -> str:
        """What to say of an answer that is not Kiln's JSON: another server (or a proxy's own page) is at KILN_URL.
        A plain-text body (a proxy's refusal) is quoted briefly; an HTML page is not."""
        kind = (headers.get("Content-Type") or "no content type").split(";")[0].strip() if headers else "?"
        text = raw.decode(errors="replace").strip()
        said = f": {' '.join(text.split())[:200]}" if text and kind == "text/plain" else ""
        return (f"{self.url} answered {method} /v1{path} with HTTP {status} ({kind}), not Kiln's JSON API{said}; "
                f"check KILN_URL: it is the root of a Kiln server (the address `kiln up` prints, e.g. {DEFAULT_URL}), "
                "or the proxy in front of it")

    def submit_sft(self, body: dict) -> dict:
        return self.submit("sft", body)

    def submit(self, kind: str, body: dict) -> dict:
        """Submit a run of training KIND (sft, grpo, opd)."""
        return self.request("POST", f"/train/{kind}", body)

    @staticmethod
    def _job_path(job_id: str, action: str = "") -> str:
        """/train/jobs/<id>[/ACTION]; the id (a full id or a prefix of 8+ hex digits) is quoted whole."""
        return f"/train/jobs/{urllib.parse.quote(job_id, safe='')}" + (f"/{action}" if action else "")

    def job(self, job_id: str) -> dict:
        return self.request("GET", self._job_path(job_id))

    def jobs(self, **query) -> dict:
        return self.request("GET", "/train/jobs", query=query)

    def cancel(self, job_id: str) -> dict:
        return self.request("POST", self._job_path(job_id, "cancel"))

    def resume(self, job_id: str, source: dict) -> dict:
        """Resume an ended job from its latest checkpoint; SOURCE is {} (its own dataset_path), {dataset_path}
        or the kind's inline field."""
        return self.request("POST", self._job_path(job_id, "resume"), source)

    def events(self, job_id: str, **query) -> dict:
        """One page of the job's log (?offset=&limit=); next_offset asks for the next, null at the end."""
        return self.request("GET", self._job_path(job_id, "events"), query=query)

    def all_events(self, job_id: str, offset: int = 0) -> list:
        """The job's events from OFFSET on (oldest first), every page of them."""
        items = []
        while offset is not None:
            page = self.events(job_id, offset=offset)
            if "next_offset" not in page:  # a server from before paging answers every event, whatever the offset
                return items + page["items"][offset:]
            items += page["items"]
            offset = page["next_offset"]
        return items

    def metrics(self, job_id: str, **query) -> dict:
        return self.request("GET", self._job_path(job_id, "metrics"), query=query)

    def teachers(self) -> dict:
        return self.request("GET", "/teachers")

    @staticmethod
    def _teacher_path(name: str) -> str:
        return f"/teachers/{urllib.parse.quote(name, safe='@')}"

    def teacher(self, name: str) -> dict:
        return self.request("GET", self._teacher_path(name))

    def create_teacher(self, body: dict) -> dict:
        return self.request("POST", "/teachers", body)

    def update_teacher(self, name: str, body: dict) -> dict:
        return self.request("PUT", self._teacher_path(name), body)

    def delete_teacher(self, name: str) -> dict:
        return self.request("DELETE", self._teacher_path(name))


def local_data_roots() -> list[Path]:
    """The data roots as this machine's environment configures them ($KILN_HOME/datasets and KILN_DATA_ROOTS);
    when the CLI runs beside the server these are the server's, so a file inside one is sent by path."""
    home = Path(os.environ.get("KILN_HOME") or "~/.kiln").expanduser()
    roots = [home / "datasets"]
    for item in (os.environ.get("KILN_DATA_ROOTS") or "").split(":"):
        if item.strip() and Path(item.strip()).expanduser().is_absolute():
            roots.append(Path(item.strip()).expanduser())
    return roots


def within_data_root(path: Path) -> bool:
    resolved = path.resolve()
    return any(resolved.is_relative_to(root.resolve()) and resolved != root.resolve() for root in local_data_roots())


class FileRecords(list):
    """read_jsonl's records, with the file they came from (`path`) and each one's line in it (`lines`)."""

    def __init__(self, records, path, lines):
        super().__init__(records)
        self.path, self.lines = path, lines


def read_jsonl(path: Path) -> FileRecords:
    """The records of a JSONL file, refusing a line that is not JSON with its number. Lines end at "\n", "\r\n" or
    "\r" (universal newlines), never at U+2028 ... inside a string; a byte-order mark is not part of line 1."""
    records, lines = [], []
    with open(path, encoding="utf-8-sig") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError as exc:
                raise ApiError(None, {"code": "invalid_file", "message": f"{path}:{number} is not JSON ({exc})"})
            lines.append(number)
    return FileRecords(records, path, lines)


def uploaded_place(body: dict | None, field: str | None) -> str | None:
    """FILE:LINE of the uploaded record that a refusal's FIELD names (data[3], groups[1].completions[0]), when BODY
    carries read_jsonl's records there; else None."""
    match = re.match(r"(\w+)\[(\d+)\]", field or "")
    records = (body or {}).get(match.group(1)) if match else None
    if not isinstance(records, FileRecords) or int(match.group(2)) >= len(records.lines):
        return None
    return f"{records.path}:{records.lines[int(match.group(2))]}"
