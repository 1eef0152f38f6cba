"""What every kernel family shares: tile configs and tiling, the softmax arithmetic,
masks and block ranges, and the Triton launch."""
