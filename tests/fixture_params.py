"""The one mapping from a recorded reference-decoder case's parameters (the `params` of the fixtures that
scripts/make_decode_fixtures.py, make_qwen35_fixture.py and friends write) to the engine's generation keywords.
The parity tests and benches/gpu/qwen35.py call it, so a parameter added to the reference decoder is mapped once."""


def generate_kwargs(p):
    """Keywords for Engine.generate that run the decoder the reference ran with `p` (everything but the cache switch,
    log-probabilities and max_tokens, which the caller sets). An approximate cache (`p["cache"]`) maps to its mode and
    settings; the caller decides whether a case with one can run uncached."""
    kw = dict(block_size=p["block_size"], acceptance=p["acceptance"], block_add_threshold=p["alpha"],
              decoded_token_threshold=p["beta"], forced_progress=p["forced"], early_stop=p["early_stop"])
    if p["threshold"] is not None:  # BACD and DUS have none
        kw["threshold"] = p["threshold"]
    s = p.get("s2d2")
    if s:
        kw.update(speculative="s2d2", verify_policy=s["policy"], verify_min_span=s["min_span"],
                  verify_score_threshold=s["score_threshold"], verify_penalty=s["penalty"],
                  verify_penalty_kind=s["penalty_kind"], verify_hysteresis=s["hysteresis"])
    c = p.get("cache")
    if c:
        kw["cache"] = c["mode"]
        if c.get("delay") is not None:
            kw["cache_delay"] = c["delay"]
        if c.get("refresh"):
            kw["refresh_interval"] = c["refresh"]
        if c.get("window"):
            kw["prefix_window"] = c["window"]
    if p.get("sub_block"):
        kw["sub_block_size"] = p["sub_block"]
    if p.get("bacd"):
        kw.update(bacd_lower=p["bacd"][0], bacd_upper=p["bacd"][1])
    if p.get("credit"):
        kw.update(credit_alpha=p["credit"]["alpha"], credit_gamma=p["credit"]["gamma"],
                  credit_beta=p["credit"]["beta"])
    if p.get("tccf"):
        t = p["tccf"]
        kw.update(tccf=True, tccf_trigger=t["trigger_text"], tccf_check=t["check_text"],
                  tccf_answer_block_size=t["answer_block"])
    return kw
