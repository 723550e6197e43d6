"""The host tier: evicted entries kept in host memory and brought back when a turn needs them.

The compression core never imports this package: a commit hands its evicted entries to
`KvEvictContext.evictions` (`cache/eviction.py`), which `demote.attach` sets to `demote.HostTier` when a
server recalls. Each module holds one part of the route:

- `host.py`: the pool of host columns, a branch's `HostEntries` (with their page summaries) and the LRU
  that drops whole branches;
- `demote.py`: a commit's evicted entries copied into host columns (`HostTier`, the eviction hook), and a
  request taking the host entries of the history it adopted (a copy, or, with no room for one, a borrow
  it reads until its append keeps an excerpt);
- `exact_prefill.py`: a turn's prefill over both tiers (its queries see the host entries too);
- `recall.py`: the turn's append (the host entries of the positions its queries attend most, over every
  layer and KV head, into fresh slots after its compression), the
  exchange a recall outside a forward runs, and the scheduler and forward hooks of a decode step's recall;
- `decode_recall.py`: a decode step's recall for the whole batch in fixed shapes, inside the forward,
  in every layer and KV head (on a CPU each layer in one compiled loop, `kernels/recall_layer_cpu.py`);
- `recall_core.py`: how host entries rank (by their page's best score; the append's positions over every
  layer and KV head first), the score floor, the counters.
"""
