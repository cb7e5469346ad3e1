"""The leaderboard and what reads it: one measured protocol per model over every
built-in (`leaderboard`), the recipe-choosing table (`choosing`), `recommend`
and the HTML report (`html`). Above eval and calibration: it runs both."""
