"""PPO and GRPO: `rollout` (generate), `experience` (score, log-probs, values, advantages), `stage` (the update),
`rewards` (reward model or function), `checks` (the config's own rules), `build` (config -> stage)."""
