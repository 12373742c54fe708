"""eagle3-assets: EAGLE-3 drafters as a Dagster asset graph.

The package has two halves: the control plane (everything but `worker/`, no torch) and the worker that
runs on the GPU host (`python -m eagle3_assets.worker <stage>`, speaks to Dagster only through dagster-pipes).
"""

__version__ = "0.1.0"
