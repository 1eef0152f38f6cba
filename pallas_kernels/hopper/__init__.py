"""The Hopper (Pallas Mosaic GPU) machinery every Hopper kernel shares: the
warp-specialised pipeline (``pipeline``), the forward kernel with its row rules
(``forward``), the per-position inputs and block ranges (``inputs``), the two
extension points, K/V addressing (``addressing``) and work items (``work``), and what
a CTA may use (``budget``)."""
