"""Teams of agents: the `Workflow` abstraction, the default search team and its prompts, teams of one's own."""
