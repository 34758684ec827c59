"""RL on finished objects: rollout trees, groups, rewards, advantages, losses, the policy, the critic, the trainer."""
