"""Operations: metrics, event-loop metrics, tracing, logs and the GC freezer."""
