"""Eviction machinery: per-head tiers and their routing, scoring, storage, allocation, merging and model passes."""
