"""Launching distributed jobs (``python -m bagua.distributed.launch``)."""
