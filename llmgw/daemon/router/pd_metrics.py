"""Prefill/decode disaggregation's metrics (docs/disaggregation.md), read from the core's
:class:`~llmgw.route.pd.PdStats` and its replicas at scrape time:

* ``llmgw_pd_requests_total{model,path}`` — a disaggregated model's requests by path: ``split``
  (a prefill step was sent), or not split and why: ``short`` (under ``min_prompt_tokens``),
  ``cached`` (under it what its decoder would compute: the rest is cached there),
  ``adapter`` (a LoRA request), ``batched`` (``n`` > 1 or several prompts), ``not_generation``
  (embeddings), ``no_prefiller`` (none could take it then);
* ``llmgw_pd_fallbacks_total{model,reason}`` — the decoder prefilled where a split was meant:
  ``no_prefiller``, ``connect``, ``timeout``, ``engine_error``, ``bad_answer``, ``no_params`` (the
  prefiller gave nothing to pull, e.g. its one token was EOS), ``decode_retry`` (a decode attempt
  failed after it was sent: the retry prefills);
* ``llmgw_pd_prefill_seconds{model}`` — the prefill step, sent to answer;
* ``llmgw_pd_transfer_seconds{model}`` — a decode attempt with the prefiller's KV, sent to its
  first byte: the blocks' transfer and the first token;
* ``llmgw_pd_transferred_blocks_total{model}`` — KV blocks handed to decoders;
* ``llmgw_pd_queue{model,role}`` — the engines' waiting requests over each role's replicas, at
  their last scrape (prefill queue, decode queue)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.daemon.router.metrics import _counter_family, _hist_family
from llmgw.route.dispatch import RouterCore
from llmgw.route.pd import PD_BUCKETS

__all__ = ["PdMetrics"]


class PdMetrics(Collector):
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    def collect(self) -> Iterable[Metric]:
        st = self.core.pd_counts()
        yield _counter_family("llmgw_pd_requests", "A disaggregated model's requests: split (prefill step sent) "
                              "or why not (short, adapter, batched, not_generation, no_prefiller).", ["model", "path"],
                              st.paths)
        yield _counter_family("llmgw_pd_fallbacks", "Split requests whose decoder prefilled instead, by reason.",
                              ["model", "reason"], st.fallbacks)
        yield _hist_family("llmgw_pd_prefill_seconds", "The prefill step: sent to the prefiller's answer.",
                           ["model"], PD_BUCKETS, st.prefill)
        yield _hist_family("llmgw_pd_transfer_seconds", "A decode attempt with the prefiller's KV: sent to its "
                           "first byte (the blocks' transfer and the first token).", ["model"], PD_BUCKETS,
                           st.transfer)
        yield _counter_family("llmgw_pd_transferred_blocks", "KV blocks handed to decoders (the prefillers' "
                              "remote_block_ids).", ["model"], st.blocks)
        q = GaugeMetricFamily("llmgw_pd_queue", "Engine waiting requests over a disaggregated model's replicas "
                              "of each role, at their last scrape.", labels=["model", "role"])
        for (name, role), n in self.core.pd_queues().items():
            q.add_metric([name, role], n)
        yield q
