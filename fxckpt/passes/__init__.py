"""Graph passes that carry out a Plan; each is GraphModule -> GraphModule."""
