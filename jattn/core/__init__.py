"""The op core every public op goes through: device facts and backends (``device``),
shared argument checks (``validation``), the ``Op`` / ``Impl`` classes with backend
and config resolution and the custom-VJP plumbing (``op``), and timing (``timing``)."""
