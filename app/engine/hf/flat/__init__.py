"""The hf engine's token-flat turn: one forward per engine turn over a flat batch of segments
(layout, KV blocks, attention, forward, scheduler)."""
