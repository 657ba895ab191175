"""The coordinator's /metrics as `mrlx bench load` reads them: scraped (signed, as every call to the
coordinator is) and one value looked up by name and labels."""

from __future__ import annotations

import urllib.request


def scrape_metrics(url: str, token: str) -> dict[str, float]:
    """The coordinator's /metrics as {'name{labels}': value} (blocking; the driver has no event loop)."""
    from mrlx_plugin.link.auth import request_target, signed_headers

    signed = signed_headers(token, "GET", request_target(url + "/metrics"))
    req = urllib.request.Request(url + "/metrics", headers=signed)
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def metric_value(m: dict[str, float], name: str, **labels: str) -> float:
    """The value of metric `name` with exactly `labels` in a scrape (0 when it is not there)."""
    rendered = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return m.get(f"{name}{{{rendered}}}" if rendered else name, 0.0)
