"""Developer and test tools: the attention oracle, real-pool fixtures, test-only hooks."""
