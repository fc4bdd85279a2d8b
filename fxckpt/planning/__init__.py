"""Pure decision-making: facts and numbers in, a Plan out."""
