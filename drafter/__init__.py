"""specdec drafter: builds draft trees with an EAGLE head, a small LM or n-grams."""
