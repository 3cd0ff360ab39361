"""Shared machinery of the op packages: kernel launch and row helpers (launch), thread-block
clusters (cluster), rows split across cooperating programs (split)."""
