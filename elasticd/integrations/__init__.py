"""elasticd's in-memory state for the frameworks people train with: their whole resumable state
(not only weights) refreshed in elasticd's shared memory at the in-memory state's cost, and resumed
after a crash through the framework's own resume path. Worker side, like the checkpoint library:
each module runs in the user's training processes and imports its framework (an optional extra,
`.[integrations]`), so importing the package alone loads none.

- `elasticd.integrations.lightning`: `ElasticdState`, a PyTorch Lightning Callback;
  `ResumableDataLoader`, a DataLoader whose place in the epoch Lightning can resume.
- `elasticd.integrations.transformers`: `resume(trainer)`, for the transformers Trainer.
- Accelerate needs no integration: docs/checkpoints.md has the recipe (`capture`/`restore` of
  `accelerator.unwrap_model(model)`, its optimizer and scheduler, `skip_first_batches`).

Worker side, like elasticd.checkpoint: these run in the user's training processes and import
nothing of the daemon's packages (tests/unit/project/test_layout.py). Each imports its framework, so
importing `elasticd.integrations` alone loads none of them. (The modules are named after the
framework they serve, the public path a script imports; absolute imports keep `import
transformers` inside them the framework's own.)
"""
