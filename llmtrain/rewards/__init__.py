"""Rule-based reward functions shipped with llmtrain (`ppo.reward.function=llmtrain.rewards.<module>:score`)."""
