"""This daemon in a fleet: registration with vLLM's router (docs/fleet.md)."""
