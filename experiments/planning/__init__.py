"""Research code behind the sharding planner, kept out of the runtime (recjax/sharding uses none of it at run time):
the neural cost model's pre-training (`cost_net.py`, NeuroShard) and the Meta-shaped 856-table set the planner is
benchmarked on (`meta_tables.py`). `benchmarks/planner.py`, `tests/test_planner.py` and the notebook
`experiments/notebooks/sharding_planner.ipynb` use them."""
