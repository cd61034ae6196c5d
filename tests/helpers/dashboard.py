"""Reading the router's ``/dashboard`` as Chromium rendered it, and checking it against
the router's ``/metrics``: shared by tests/router/test_router_dashboard.py (mocked engines) and
tests/e2e/test_router_e2e.py (real vLLM).

The page's contract (router/ops/dashboard.py): every number carries ``data-metric`` (the
sample, ``name{label=value,...}``) or an ``id``. Checks compare what the page shows with
the scrape: counts exactly, other numbers to the precision shown. Values that move
without traffic (queue seconds, prefix heat) are only checked to be numbers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, float]  # "name{label=value,...}" (labels sorted) -> value
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
         "track", "wbr"}


@dataclass
class Page:
    """What a rendered dashboard shows."""

    metrics: dict[str, str] = field(default_factory=dict)  # data-metric -> text
    ids: dict[str, str] = field(default_factory=dict)  # id -> text
    hidden: set[str] = field(default_factory=set)  # ids of hidden elements
    rows: dict[str, list[list[str]]] = field(default_factory=dict)  # tbody id -> cell texts


class _Reader(HTMLParser):
    """Collects the text of every element with an ``id`` or ``data-metric`` (their text
    is all in one text node or none) and the cell texts of every ``tbody`` row."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self._open: list[tuple[str, str | None, str | None]] = []  # tag, id, metric
        self._texts: list[str] = []
        self._tbody: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if "hidden" in a and a.get("id"):
            self.page.hidden.add(str(a["id"]))
        if tag in _VOID:  # no end tag, no text
            return
        ident = a.get("id")
        if tag == "tbody" and ident:
            self._tbody = ident
            self.page.rows[ident] = []
        elif tag == "tr" and self._tbody is not None:
            self.page.rows[self._tbody].append([])
        self._open.append((tag, ident, a.get("data-metric")))
        self._texts.append("")

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            t, ident, metric = self._open.pop()
            text = self._texts.pop().strip()
            if ident:
                self.page.ids[ident] = text
            if metric:
                self.page.metrics[metric] = text
            if t == "td" and self._tbody is not None and self.page.rows[self._tbody]:
                self.page.rows[self._tbody][-1].append(text)
            if t == "tbody":
                self._tbody = None
            if self._texts:
                self._texts[-1] += text
            if t == tag:
                break

    def handle_data(self, data: str) -> None:
        if self._texts:
            self._texts[-1] += data


def read_page(dom: str) -> Page:
    reader = _Reader()
    reader.feed(dom)
    reader.close()
    return reader.page


def scrape(text: str) -> Samples:
    """Prometheus text -> samples keyed as the page keys them (labels sorted by name)."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _num(text: str) -> float:
    m = re.fullmatch(r"[<>≤ ]*(-?[0-9]+(?:\.[0-9]+)?)%?", text)
    assert m, f"not a number: {text!r}"
    return float(m.group(1))


def _close(shown: str, value: float, what: str) -> None:
    """``shown`` is ``value`` rounded to the decimals it shows."""
    decimals = len(shown.rstrip("%").partition(".")[2])
    assert abs(_num(shown) - value) <= 0.5 * 10 ** -decimals + 1e-9, (what, shown, value)


def _of(samples: Samples, prefix: str) -> dict[str, float]:
    return {k: v for k, v in samples.items() if k.startswith(prefix)}


def median_error(samples: Samples) -> tuple[float, float]:
    """(estimate, bucket upper bound) of the median of kvc_router_ttft_relative_error,
    linear within its bucket as the page (and histogram_quantile) computes it."""
    buckets = sorted((float(k.split("le=")[1].rstrip("}")), v) for k, v in
                     _of(samples, "kvc_router_ttft_relative_error_bucket{").items())
    rank = buckets[-1][1] / 2
    lo = below = 0.0
    for le, cum in buckets:
        if cum >= rank:
            return (lo if math.isinf(le) else lo + (le - lo) * (rank - below) / (cum - below),
                    le)
        lo, below = le, cum
    raise AssertionError(buckets)


def check(page: Page, samples: Samples) -> None:
    """Assert ``page`` shows exactly what ``samples`` hold (see the module docstring)."""
    assert "error" in page.hidden, page.ids.get("error")
    assert page.ids["updated"] != "never"
    _check_instances(page, samples)
    for kind in ("predicted", "actual"):
        n = samples[f"kvc_router_ttft_{kind}_seconds_count"]
        assert page.ids[f"ttft-{kind}-count"] == f"{n:.0f}"
        if n:
            _close(page.ids[f"ttft-{kind}-mean"],
                   1000 * samples[f"kvc_router_ttft_{kind}_seconds_sum"] / n, kind)
    n_err = samples["kvc_router_ttft_relative_error_count"]
    assert page.ids["ttft-error-count"] == f"{n_err:.0f}"
    if n_err:
        est, bound = median_error(samples)
        if math.isinf(bound):
            assert page.ids["ttft-error-median"] == f"> {100 * est:.0f}%"
        else:
            _close(page.ids["ttft-error-median"], 100 * est, "median error")
            assert page.ids["ttft-error-bound"] == f"(≤ {100 * bound:.0f}%)"
    prompt = sum(_of(samples, "kvc_router_prompt_tokens_total{").values())
    assert page.ids["prompt-tokens"] == f"{prompt:.0f}"
    for tier in ("engine", "store_dram", "store_disk"):
        k = f"kvc_router_predicted_hit_tokens_by_tier_total{{tier={tier}}}"
        assert page.metrics[k] == f"{samples[k]:.0f}", k
        if prompt:
            _close(page.ids[f"hit-share-{tier}"], 100 * samples[k] / prompt, tier)
    for prefix in ("kvc_router_requests_total{", "kvc_router_rejections_total{"):
        want = {k: f"{v:.0f}" for k, v in _of(samples, prefix).items()}
        assert _of_text(page, prefix) == want, prefix
    heat = _of(samples, "kvc_router_prefix_heat{")
    assert _of_text(page, "kvc_router_prefix_heat{").keys() == heat.keys()
    for k in heat:
        rep = k.replace("_heat{", "_replicas{")
        assert page.metrics[rep] == f"{samples[rep]:.0f}", rep
        _num(page.metrics[k])


def _of_text(page: Page, prefix: str) -> dict[str, str]:
    return {k: v for k, v in page.metrics.items() if k.startswith(prefix)}


def _check_instances(page: Page, samples: Samples) -> None:
    healthy = _of(samples, "kvc_router_instance_healthy{")
    roles = dict(re.findall(r"instance=([^,}]*),role=([^,}]*)", ",".join(healthy)))
    rows = {r[0]: r for r in page.rows["instances"]}
    assert rows.keys() == roles.keys(), (rows, roles)
    for name, role in roles.items():
        up = healthy[f"kvc_router_instance_healthy{{instance={name},role={role}}}"] == 1
        assert rows[name][1:3] == [role, "up" if up else "down"], rows[name]

        def val(metric: str, name: str = name) -> float:
            return samples[f"kvc_router_instance_{metric}{{instance={name}}}"]

        def shown(metric: str, name: str = name) -> str:
            return page.metrics[f"kvc_router_instance_{metric}{{instance={name}}}"]

        for metric in ("running", "waiting", "decodes", "resident_blocks"):
            assert shown(metric) == f"{val(metric):.0f}", (name, metric)
        _close(shown("kv_usage"), 100 * val("kv_usage"), f"{name} kv_usage")
        _num(shown("queue_seconds"))  # decays with time: a number is all that is stable
