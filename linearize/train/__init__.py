"""Training: data sources and packing (``linearize.train.data``) and the training recipes."""
