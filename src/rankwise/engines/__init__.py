"""Engines: what runs a validated collective call for a group.

The API checks arguments locally and describes the call (``base.Call``); the group's
engine moves the bytes. ``message`` runs the pure algorithms over per-peer transports
(TCP today); ``shm`` runs collectives straight on a shared segment when every rank of a
group is on one host; ``select`` decides per group. Engines never import the API.
"""
