"""Training: the conversion recipes (data sources and packing live in ``linearize.data``)."""
