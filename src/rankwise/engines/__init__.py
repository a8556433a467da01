"""Engines: what runs a group's collectives once the API has validated a call.

See ``/work/shared/DESIGN.md`` ("Engines"). ``engines.shm`` runs collectives straight on a
shared-memory segment for groups whose ranks share one host.
"""
