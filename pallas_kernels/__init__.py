"""``jattn.kernels``: the Pallas GPU kernels behind jattn, forward and backward, with
the host-side padding to their tiles. One folder per kernel family; what they share
(tiles, softmax arithmetic, masks, the Triton launch) is in ``common``. Nothing here
knows of Flax, torch or the op layer above."""
