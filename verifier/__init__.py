"""specdec verifier: hosts the target model and verifies draft trees in one forward."""
