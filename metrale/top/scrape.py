"""One scrape of a metrale server: `/metrics` (Prometheus text, parsed by
`prometheus_client.parser`) and `/v1/models`, at one monotonic time.

Owner: top.

Invariants:
- Every failure is a `TopError` with a one-line message and the exit status the command uses:
  1 when the server cannot be reached or does not answer like a metrale server, 2 when it
  refuses the API key (or the URL is malformed). No traceback reaches the user.
- Only the standard library's HTTP client is used (no extra dependency for a client).
- `/metrics` never needs the key; `/v1/models` gets it as `Authorization: Bearer`.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

#: (name, sorted label pairs) -> value; sample names as exposed (`_total`, `_bucket`, ...).
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class TopError(Exception):
    """A failure `metrale top` reports as one line, exiting with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


@dataclass
class Scrape:
    """What the server said at `time` (monotonic seconds)."""

    time: float
    samples: Samples
    models: list[dict[str, Any]] = field(default_factory=list)

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, tuple(sorted(labels.items()))))

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        """Every sample named `name`, with its labels."""
        return [(dict(labels), v) for (n, labels), v in self.samples.items() if n == name]

    def has_prefix(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n, _ in self.samples)


def normalize_url(url: str) -> str:
    """`HOST:PORT` or `http(s)://HOST:PORT[/]` -> `http(s)://HOST:PORT` (a `TopError` (2)
    for anything else)."""
    if "://" not in url:
        url = "http://" + url
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise TopError(f"--url {url!r} is not an http(s)://HOST:PORT address", exit_code=2)
    return url.rstrip("/")


def parse_metrics(text: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return samples


def _get(url: str, api_key: str | None, timeout: float) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": "*/*"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise TopError(
                f"{url}: the server refused the API key ({exc.code}); pass --api-key or set "
                "$METRALE_API_KEY",
                exit_code=2,
            ) from None
        raise TopError(f"{url}: HTTP {exc.code} {exc.reason}; is this a metrale server?") from None
    except urllib.error.URLError as exc:
        reason = exc.reason.strerror if isinstance(exc.reason, OSError) else exc.reason
        raise TopError(f"cannot reach {url}: {reason or exc}") from None
    except TimeoutError:
        raise TopError(f"cannot reach {url}: no answer in {timeout:g} s") from None
    except (OSError, ValueError) as exc:
        raise TopError(f"cannot reach {url}: {exc}") from None


def scrape(base_url: str, api_key: str | None = None, timeout: float = 5.0) -> Scrape:
    """`/metrics` then `/v1/models` of the server at `base_url`."""
    raw = _get(base_url + "/metrics", None, timeout)
    now = time.monotonic()
    try:
        samples = parse_metrics(raw.decode("utf-8", errors="replace"))
    except ValueError as exc:
        raise TopError(f"{base_url}/metrics is not Prometheus text ({exc})") from None
    if not any(name.startswith("metrale_") for name, _ in samples):
        raise TopError(f"{base_url}/metrics has no metrale_* series; is this a metrale server?")
    try:
        models = json.loads(_get(base_url + "/v1/models", api_key, timeout)).get("data") or []
    except (json.JSONDecodeError, AttributeError):
        raise TopError(f"{base_url}/v1/models did not answer a model list") from None
    return Scrape(now, samples, models)
