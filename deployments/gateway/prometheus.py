"""The gateways' usage on the panel's /metrics: all-time counters per (key, model name, deployment). Totals only,
never an hour label, so a series lives as long as its key and the label sets stay as small as the
combinations ever used (Prometheus makes the hours with rate())."""
from prometheus_client.core import CounterMetricFamily

from deployments.gateway import selectors

HELP = {"requests": "Requests callers made through the node gateways.",
        "errors": "Of those, the ones answered with an error (the gateway's own refusals included).",
        "refused": "Of the errors, the 429s: refused for load (a key's limit, a queue bound, the engine's admission cap).",
        "prompt_tokens": "Prompt tokens of those requests, as the engines counted them.",
        "reasoning_tokens": "Output tokens the reasoning parser put in the reasoning part.",
        "content_tokens": "Output tokens of the answers' content (output minus reasoning)."}
LABELS = ["key", "key_prefix", "model", "deployment"]


class UsageCollector:
    def collect(self):
        rows = selectors.usage_totals()
        families = {m: CounterMetricFamily(f"panel_gateway_{m}", HELP[m], labels=LABELS) for m in selectors.MEASURES}
        for row in rows:
            labels = [row["key__name"] or "(deleted key)", row["key__prefix"] or "", row["model_name"],
                      row["deployment__name"] or "(deleted deployment)"]
            for m, family in families.items():
                family.add_metric(labels, row[m] or 0)
        yield from families.values()
