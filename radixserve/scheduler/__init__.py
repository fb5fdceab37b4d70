"""Scheduling: turning requests into forward batches and running them to completion."""
