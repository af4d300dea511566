"""The IPC substrate: wire messages, typed ZeroMQ queues, shared-memory arrays, the runtime directory."""
