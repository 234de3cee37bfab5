"""Tasks shipped with llmtrain for the tiny recipes that need more than data: a tool the model calls, the reward that
scores it, and the generator of the task's data in llmtrain/assets/data (`python -m llmtrain.tasks.<task>`)."""
