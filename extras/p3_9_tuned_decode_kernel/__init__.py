"""Phase 3.9's decode kernel's launch table (speed only), off the reading path."""
