"""The tools built on the engine's public boundary (events, public attributes, `state_dict()`): compare, plan, doctor,
export, info and the built-in tasks. Nothing below `ampkit.tools` imports from here."""
