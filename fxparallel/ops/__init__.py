"""What runs on every call: the collectives the generated code calls, the vocab-parallel embedding and
cross-entropy, the context-parallel exchange, dropout masks, the decoder-layer modules, and the record of a
rewritten graph the module keeps. Below both the rewrite stage (which writes code that calls these) and the
module (which calls them)."""
