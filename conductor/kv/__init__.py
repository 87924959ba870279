"""KV-cache awareness: prompt analysis, the analyzer over the KV index, agreement checks and event metrics."""
