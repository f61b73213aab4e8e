"""One module per model family, each registering its `ModelFamily` record (see `rl_megatron.models.family`).
`rl_megatron.models.family` imports every module here, so a new family's file needs no other change."""
