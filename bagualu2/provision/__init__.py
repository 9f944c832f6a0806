"""The provisioner's pieces: each owns one thing a ``Provisioner`` (``bagualu2/provisioner.py``,
where ``enable`` and ``on_gating`` are) decides with, and keeps its own state.

- ``stacking.py``: how many micro-batches are in flight on this rank (``Stacking``);
- ``footprint.py``: what one micro-batch holds that no plan releases, and the room that leaves
  under the budget (``Footprint``);
- ``routing.py``: the tokens per expert each MoE layer routed (``RoutingRecord``);
- ``calibration.py``: which micro-batches release all they can to measure what releases cost
  (``Calibration``);
- ``copy_engine.py``: the copy engine a provisioner makes, what its copies cost, and its arena;
- ``unplanned.py``: saved keys no plan can name, and telling the user why (``UnplannedKeys``);
- ``learned.py``: those pieces together, what a checkpoint saves (``Learned``);
- ``counters.py``: what a run counts apart from what it learns (``RunCounters``);
- ``state.py``: the learned state a checkpoint saves and a resumed run loads
  (``Provisioner.state_dict`` / ``load_state_dict``);
- ``forward.py``: the forward put on a provisioned model, where it went and what it calls
  (``Wrapping``), and the provisioners running on each thread.
"""
