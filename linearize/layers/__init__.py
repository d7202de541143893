"""nn.Modules that replace a model's attention, reusing its q/k/v/o projections."""
