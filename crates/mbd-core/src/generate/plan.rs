//! One place where a request meets a model: `plan` resolves a `GenRequest` over the model's profile and family defaults
//! ([`Profile::decode_defaults`](crate::params::profile::Profile::decode_defaults)) into everything a generation runs
//! with (`Plan`), checking what the request may not combine (the cache modes and the attention, S2D2 and its
//! parameters, the context).

use crate::decode::cache_policy::{CacheMode, CachePolicy, PrefixWindow, DEFAULT_CACHE_DELAY};
use crate::decode::credit::CreditParams;
use crate::decode::decoder::{block_layout, Acceptance, DecodeParams, DEFAULT_BACD_BOUNDS};
use crate::decode::grammar::compile::GrammarSpec;
use crate::decode::grammar::constraint::Constraint;
use crate::decode::penalties::{parse_bias, Penalties};
use crate::decode::sampling::SamplingParams;
use crate::decode::speculative::{PenaltyKind, SpecParams, Speculative};
use crate::decode::strided::DEFAULT_STRIDE;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::net::mask::{Alignment, AttentionKind, BlockGrid};
use crate::params::request::{GenRequest, Params, TraceMode};

/// TCCF's defaults (TDAR's `tdar_eval_tccf.yaml` and `tdar_sample_tccf.py`).
pub const TCCF_TRIGGER: &str = "</think>";
pub const TCCF_CHECK: &str = "Let's check if there are any mistakes and give the final answer.";
pub const TCCF_ANSWER_BLOCK: usize = 1;

/// TCCF (TDAR's think coarse, critic fine), resolved: the trigger token, the check text's tokens and the answer's
/// block size.
#[derive(Debug, Clone, PartialEq)]
pub struct Tccf {
    pub trigger: u32,
    pub check: Vec<u32>,
    pub answer_block: usize,
}

/// Default completion length: 256 tokens, or what is left of the context.
pub const DEFAULT_MAX_TOKENS: usize = 256;
/// Default cap on forward passes.
const DEFAULT_MAX_FORWARD_PASSES: usize = 10_000;

/// A request resolved over a model: what one generation runs with.
pub struct Plan {
    pub prompt_len: usize,
    /// Completion positions (`max_tokens`, or its default).
    pub max_tokens: usize,
    pub mask_id: u32,
    pub decode: DecodeParams,
    /// The generated region's blocks ([`decoder::block_layout`](crate::decode::decoder::block_layout)).
    pub blocks: Vec<(usize, usize, usize)>,
    pub grid: BlockGrid,
    pub cache: CachePolicy,
    pub sampling: SamplingParams,
    /// The logits controls (penalties, logit_bias), where any is set.
    pub penalties: Option<Penalties>,
    /// S2D2's routing parameters (None: no S2D2).
    pub spec: Option<SpecParams>,
    /// ISD's stride (None: no ISD).
    pub isd: Option<usize>,
    /// CreditDecoding's parameters (acceptance="credit").
    pub credit: Option<CreditParams>,
    /// TCCF's switch (tccf=True).
    pub tccf: Option<Tccf>,
    /// The grammar the output keeps to (`response_format`, `grammar`, `regex`), compiled.
    pub constraint: Option<Constraint>,
    pub stop: Vec<String>,
    pub trace: TraceMode,
    pub logprobs: Option<usize>,
}

/// Resolve `req` for `prompt` over `model`'s profile and family defaults. Parameter ranges are checked by
/// `req.validate()` ([`request::PARAMS`](crate::params::request::PARAMS)); the rules that join parameters, the model
/// and the prompt are here.
pub fn plan(model: &Model, prompt: &[u32], req: &GenRequest) -> Result<Plan> {
    req.validate()?;
    let p = &model.profile;
    if prompt.is_empty() {
        return Err(Error::invalid("prompt is empty (0 tokens); give at least one token"));
    }
    model.check_ids("prompt", prompt)?;
    let mask_id = p.mask_token_id.ok_or_else(|| {
        Error::invalid(format!(
            "this model ({}) has no mask token id; pass mask_token_id=... to Engine.load",
            p.architecture
        ))
    })?;
    let lp = prompt.len();
    let max_ctx = model.config.max_position_embeddings;
    let n = req.max_tokens.unwrap_or_else(|| DEFAULT_MAX_TOKENS.min(max_ctx.saturating_sub(lp)).max(1));
    if n > max_ctx.saturating_sub(lp) {
        return Err(Error::ContextLength(format!(
            "maximum context is {max_ctx} tokens; requested {} ({lp} prompt + {n} completion)",
            lp as u128 + n as u128
        )));
    }
    let stop_token_ids = req.stop_token_ids.clone().unwrap_or_default();
    model.check_ids("stop_token_ids", &stop_token_ids)?;
    let mut eos_ids = p.eos_token_ids.clone();
    for t in stop_token_ids {
        if !eos_ids.contains(&t) {
            eos_ids.push(t);
        }
    }
    let tccf = tccf(model, req, &eos_ids)?;
    if let Some(t) = &tccf {
        eos_ids.push(t.trigger); // thinking ends at the trigger as at an EOS, then the answer begins
    }
    let d = p.decode_defaults();
    let spec = speculative(req, p.attention)?;
    if spec.is_some() && model.is_hybrid() && !p.logits_shift {
        return Err(Error::invalid(format!(
            "speculative='s2d2' on this model ({}) verifies with a mask row beside each draft (two rows per \
             position), which its Gated DeltaNet layers (a recurrence over positions in order) cannot run",
            p.architecture
        )));
    }
    let isd = strided(req, p.attention, p.logits_shift)?;
    let constraint = match grammar_spec(req)? {
        None => None,
        Some((field, g)) => {
            if tccf.is_some() {
                return Err(Error::invalid(format!(
                    "{field} does not combine with tccf (its check text is written into the output)"
                )));
            }
            if req.logprobs.is_some() {
                return Err(Error::invalid(format!(
                    "{field} does not combine with logprobs in this version (the tokens the grammar forces have no \
                     forward of their own)"
                )));
            }
            Some(model.constraint(field, &g, &eos_ids)?)
        }
    };
    let sub_block_size = if isd.is_some() { None } else { req.sub_block_size.or(d.sub_block_size) };
    let acceptance = req.acceptance.unwrap_or(d.acceptance);
    let (bacd_bounds, credit) = acceptance_params(req, acceptance)?;
    let params = DecodeParams {
        threshold: req.threshold.unwrap_or(d.threshold),
        acceptance,
        block_add_threshold: req.block_add_threshold.unwrap_or(d.block_add_threshold),
        decoded_token_threshold: req.decoded_token_threshold.unwrap_or(d.decoded_token_threshold),
        forced_progress: req.forced_progress.unwrap_or(d.forced_progress),
        early_stop: req.early_stop.unwrap_or(true),
        max_forward_passes: req.max_forward_passes.unwrap_or(DEFAULT_MAX_FORWARD_PASSES),
        eos_ids,
        sub_block_size,
        ar_block_start: sub_block_size.is_some() && p.logits_shift,
        bacd_bounds,
    };
    let sampling = SamplingParams {
        temperature: req.temperature.unwrap_or(0.0),
        top_k: req.top_k.unwrap_or(0),
        top_p: req.top_p.unwrap_or(1.0),
        min_p: req.min_p.unwrap_or(0.0),
        seed: req.seed,
    };
    let penalties = penalties(model, prompt, req)?;
    let b = req.block_size.unwrap_or(if p.attention == AttentionKind::Causal { 1 } else { p.block_size });
    let (grid, absolute) = match p.attention {
        AttentionKind::BlockCausal => {
            (BlockGrid::new(AttentionKind::BlockCausal, b, p.alignment, lp)?, p.alignment == Alignment::Absolute)
        }
        AttentionKind::Causal => (BlockGrid::causal(), false),
        AttentionKind::Full => (BlockGrid::new(AttentionKind::Full, b, Alignment::Prompt, lp)?, false),
    };
    Ok(Plan {
        prompt_len: lp,
        max_tokens: n,
        mask_id,
        decode: params,
        // ISD writes where its drafts land: one block, all of it active (the decoder keeps the EOS fill and stops)
        blocks: if isd.is_some() { block_layout(lp, n, n, false) } else { block_layout(lp, n, b, absolute) },
        grid,
        cache: cache_policy(grid.kind, req, model.is_hybrid())?,
        sampling,
        penalties,
        spec,
        isd,
        credit,
        tccf,
        constraint,
        stop: req.stop.clone().unwrap_or_default(),
        trace: req.trace.unwrap_or(TraceMode::Off),
        logprobs: req.logprobs,
    })
}

/// The request's grammar (`response_format` other than text, `grammar` or `regex`: at most one of them), with the field
/// it came from; None for free text.
fn grammar_spec(req: &GenRequest) -> Result<Option<(&'static str, GrammarSpec)>> {
    let format = match req.response_format.as_deref() {
        Some(text) => response_format(text)?,
        None => None,
    };
    let mut specs: Vec<(&'static str, GrammarSpec)> = vec![];
    if let Some(f) = format {
        specs.push(("response_format", f));
    }
    if let Some(g) = &req.grammar {
        specs.push(("grammar", GrammarSpec::Grammar(g.clone())));
    }
    if let Some(r) = &req.regex {
        specs.push(("regex", GrammarSpec::Regex(r.clone())));
    }
    if specs.len() > 1 {
        return Err(Error::invalid(format!(
            "{} each constrain the output: give one of them",
            specs.iter().map(|(f, _)| *f).collect::<Vec<_>>().join(" and ")
        )));
    }
    Ok(specs.pop())
}

/// OpenAI's `response_format`: {"type": "text"} (None: free text), {"type": "json_object"}, or {"type": "json_schema",
/// "json_schema": {"name": ..., "schema": {...}, "strict": ...}} (a bare schema under "schema" is taken too, as
/// llama.cpp's and vLLM's servers take it).
fn response_format(text: &str) -> Result<Option<GrammarSpec>> {
    use serde_json::Value;
    let bad = |why: String| Error::invalid(format!("response_format: {why}"));
    let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON ({e})")))?;
    let Value::Object(m) = &v else {
        return Err(bad(format!("must be an object with a 'type', got {}", crate::load::json::shown(&v))));
    };
    let kind = m
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("must have a 'type': 'text', 'json_object' or 'json_schema'".to_string()))?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(GrammarSpec::JsonObject)),
        "json_schema" => {
            let schema = match m.get("json_schema") {
                Some(Value::Object(js)) => js.get("schema").cloned().ok_or_else(|| {
                    bad("json_schema must have a 'schema' (the JSON Schema the output matches)".to_string())
                })?,
                Some(other) => {
                    return Err(bad(format!("json_schema must be an object, got {}", crate::load::json::shown(other))))
                }
                None => m.get("schema").cloned().ok_or_else(|| {
                    bad("type 'json_schema' needs 'json_schema': {\"name\": ..., \"schema\": {...}}".to_string())
                })?,
            };
            if !schema.is_object() && !schema.is_boolean() {
                return Err(bad(format!(
                    "the schema must be a JSON Schema object, got {}",
                    crate::load::json::shown(&schema)
                )));
            }
            Ok(Some(GrammarSpec::JsonSchema(schema)))
        }
        other => Err(bad(format!("type must be 'text', 'json_object' or 'json_schema', got '{other}'"))),
    }
}

/// The cache policy of a request: `cache` (with `cache_delay`, `refresh_interval`) and `use_cache`, over the
/// model's attention. Default: exact where K/V become final (block-causal, causal), none for full attention.
/// `hybrid`: the model has recurrent layers, whose state the approximate caches cannot refresh or splice.
fn cache_policy(attention: AttentionKind, req: &GenRequest, hybrid: bool) -> Result<CachePolicy> {
    let (cache, use_cache, delay, refresh) = (req.cache, req.use_cache, req.cache_delay, req.refresh_interval);
    let prefix_only = req.given(&["cache_delay", "refresh_interval", "prefix_window"]);
    if cache != Some(CacheMode::Prefix) && !prefix_only.is_empty() {
        return Err(Error::invalid(format!("{} only with cache='prefix'", prefix_only.join(" and "))));
    }
    let full = attention == AttentionKind::Full;
    match (cache, use_cache) {
        (Some(c), Some(false)) if c != CacheMode::None => {
            Err(Error::invalid(format!("use_cache=False contradicts cache='{}'", c.name())))
        }
        (Some(CacheMode::Exact), _) if full => Err(Error::invalid(
            "cache='exact' needs block-causal or causal attention: with full attention no K/V is ever final \
             (use cache='prefix' for the approximate cache, or 'none')",
        )),
        (Some(c @ (CacheMode::Prefix | CacheMode::Dual)), _) if !full => Err(Error::invalid(format!(
            "cache='{}' is an approximate cache for full attention; this model's attention is block-causal or \
             causal, whose K/V are cached exactly (cache='exact', the default)",
            c.name()
        ))),
        (Some(c @ (CacheMode::Prefix | CacheMode::Dual)), _) if hybrid => Err(Error::invalid(format!(
            "cache='{}' is an approximate cache: it refreshes and splices cached positions, which this model's Gated \
             DeltaNet layers cannot (their recurrent state only moves forward); use cache='none' with full attention",
            c.name()
        ))),
        (Some(CacheMode::Dual), _) => Ok(CachePolicy::Dual),
        (Some(CacheMode::Prefix), _) => Ok(CachePolicy::Prefix {
            delay: delay.unwrap_or(DEFAULT_CACHE_DELAY),
            refresh,
            window: req.prefix_window.unwrap_or(PrefixWindow::Canvas),
        }),
        (Some(CacheMode::None), _) | (None, Some(false)) => Ok(CachePolicy::Recompute),
        _ if full => Ok(CachePolicy::Recompute),
        _ => Ok(CachePolicy::Exact),
    }
}

/// S2D2's routing parameters of a request (None: no speculation). The verify_* parameters need
/// speculative="s2d2", and verification needs block-causal or causal attention.
/// The logits controls of `req` (None where none changes a logit). S2D2 and ISD verify drafts against the raw
/// distribution, so they take none in this version.
fn penalties(model: &Model, prompt: &[u32], req: &GenRequest) -> Result<Option<Penalties>> {
    let bias = match req.logit_bias.as_deref() {
        Some(j) => parse_bias(j, model.config.vocab_size)?,
        None => vec![],
    };
    let mut prompt: Vec<u32> = prompt.to_vec();
    prompt.sort_unstable();
    prompt.dedup();
    let p = Penalties {
        presence: req.presence_penalty.unwrap_or(0.0),
        frequency: req.frequency_penalty.unwrap_or(0.0),
        repetition: req.repetition_penalty.unwrap_or(1.0),
        bias,
        prompt,
    };
    if !p.is_active() {
        return Ok(None);
    }
    if let Some(s) = req.speculative.filter(|s| *s != Speculative::Off) {
        let set = req.given(&["presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"]);
        return Err(Error::invalid(format!(
            "{} does not combine with speculative='{}' in this version (its drafts are verified against the raw \
             distribution)",
            set.join(", "),
            s.name()
        )));
    }
    Ok(Some(p))
}

fn speculative(req: &GenRequest, attention: AttentionKind) -> Result<Option<SpecParams>> {
    let on = req.speculative == Some(Speculative::S2d2);
    let verify = [
        "verify_policy",
        "verify_min_span",
        "verify_score_threshold",
        "verify_penalty",
        "verify_penalty_kind",
        "verify_hysteresis",
    ];
    only_with(req, &verify, on, "speculative='s2d2'")?;
    if !on {
        return Ok(None);
    }
    if attention == AttentionKind::Full {
        return Err(Error::invalid(
            "speculative='s2d2' verifies at block size 1, which needs block-causal or causal attention; this \
             model uses full attention",
        ));
    }
    let hysteresis = match &req.verify_hysteresis {
        Some(v) => SpecParams::hysteresis_pair(v)?,
        None => SpecParams::DEFAULT_HYSTERESIS,
    };
    Ok(Some(SpecParams {
        policy: req.verify_policy.unwrap_or(SpecParams::DEFAULT_POLICY),
        min_span: req.verify_min_span.unwrap_or(SpecParams::DEFAULT_MIN_SPAN),
        score_threshold: req.verify_score_threshold.unwrap_or(SpecParams::DEFAULT_SCORE_THRESHOLD),
        penalty: req.verify_penalty.unwrap_or(SpecParams::DEFAULT_PENALTY),
        penalty_kind: req.verify_penalty_kind.unwrap_or(PenaltyKind::Static),
        hysteresis,
    }))
}

/// ISD's stride of a request (None: no ISD). ISD decodes with a strictly causal in-flight block and shifted logits
/// (I-DLM), so it needs a model loaded as causal and shifted; the multi-block decoder's parameters do not apply.
fn strided(req: &GenRequest, attention: AttentionKind, shift: bool) -> Result<Option<usize>> {
    let on = req.speculative == Some(Speculative::Isd);
    only_with(req, &["isd_stride"], on, "speculative='isd'")?;
    if !on {
        return Ok(None);
    }
    if attention != AttentionKind::Causal || !shift {
        return Err(Error::invalid(format!(
            "speculative='isd' decodes with a strictly causal in-flight block and shifted logits (the row of \
             position i predicts i + 1); this model is loaded with {} attention{}: load I-DLM checkpoints with \
             attention='causal', logits_shift=True",
            attention.name(),
            if shift { "" } else { " and unshifted logits" }
        )));
    }
    let set = req.given(&[
        "block_size",
        "threshold",
        "acceptance",
        "block_add_threshold",
        "decoded_token_threshold",
        "forced_progress",
        "sub_block_size",
    ]);
    if !set.is_empty() {
        let verb = if set.len() == 1 { "does" } else { "do" };
        return Err(Error::invalid(format!(
            "{} {verb} not apply with speculative='isd' (a step forwards the pending token, up to isd_stride - 1 \
             drafts and as many masks, and writes 1 to isd_stride tokens)",
            set.join(", ")
        )));
    }
    Ok(Some(req.isd_stride.unwrap_or(DEFAULT_STRIDE)))
}

/// The parameters of the acceptance rules that have their own (BACD's bounds, CreditDecoding's), each only with
/// its rule; `threshold` does not apply to BACD (its bounds) or DUS (a schedule).
fn acceptance_params(req: &GenRequest, acceptance: Acceptance) -> Result<((f64, f64), Option<CreditParams>)> {
    only_with(req, &["bacd_lower", "bacd_upper"], acceptance == Acceptance::Bacd, "acceptance='bacd'")?;
    only_with(
        req,
        &["credit_alpha", "credit_gamma", "credit_beta"],
        acceptance == Acceptance::Credit,
        "acceptance='credit'",
    )?;
    if matches!(acceptance, Acceptance::Bacd | Acceptance::Dus) && req.threshold.is_some() {
        return Err(Error::invalid(format!(
            "threshold does not apply with acceptance='{}' ({})",
            acceptance.name(),
            if acceptance == Acceptance::Bacd {
                "its threshold moves between bacd_lower and bacd_upper"
            } else {
                "it unmasks by a fixed schedule"
            }
        )));
    }
    let bounds = (req.bacd_lower.unwrap_or(DEFAULT_BACD_BOUNDS.0), req.bacd_upper.unwrap_or(DEFAULT_BACD_BOUNDS.1));
    if bounds.0 > bounds.1 {
        return Err(Error::invalid(format!("bacd_lower ({}) must not exceed bacd_upper ({})", bounds.0, bounds.1)));
    }
    let d = CreditParams::DEFAULT;
    let credit = (acceptance == Acceptance::Credit).then(|| CreditParams {
        alpha: req.credit_alpha.unwrap_or(d.alpha),
        gamma: req.credit_gamma.unwrap_or(d.gamma),
        beta: req.credit_beta.unwrap_or(d.beta),
    });
    Ok((bounds, credit))
}

/// TCCF of a request (None: off). It switches block sizes at a block boundary, so it needs block-causal or causal
/// attention; it does not combine with speculation (whose drafts span the switch) or log-probabilities (the check
/// text is not the model's).
fn tccf(model: &Model, req: &GenRequest, eos_ids: &[u32]) -> Result<Option<Tccf>> {
    let on = req.tccf == Some(true);
    only_with(req, &["tccf_trigger", "tccf_check", "tccf_answer_block_size"], on, "tccf=True")?;
    if !on {
        return Ok(None);
    }
    let p = &model.profile;
    if p.attention == AttentionKind::Full {
        return Err(Error::invalid(
            "tccf switches block sizes at a block boundary, which needs block-causal or causal attention; this \
             model uses full attention",
        ));
    }
    if let Some(s) = req.speculative.filter(|s| *s != Speculative::Off) {
        return Err(Error::invalid(format!("tccf does not combine with speculative='{}'", s.name())));
    }
    if req.logprobs.is_some() {
        return Err(Error::invalid("tccf does not combine with logprobs (its check text is not the model's)"));
    }
    let text = req.tccf_trigger.as_deref().unwrap_or(TCCF_TRIGGER);
    let ids = model.text_ids("tccf_trigger", text)?;
    let [trigger] = ids[..] else {
        return Err(Error::invalid(format!("tccf_trigger {text:?} must be one token of this model's vocabulary")));
    };
    if eos_ids.contains(&trigger) {
        return Err(Error::invalid(format!("tccf_trigger {text:?} is an end-of-text token of this request")));
    }
    if model.profile.mask_token_id == Some(trigger) {
        return Err(Error::invalid(format!(
            "tccf_trigger {text:?} is the mask token, which the model never writes: the switch would never happen"
        )));
    }
    let check = model.text_ids("tccf_check", req.tccf_check.as_deref().unwrap_or(TCCF_CHECK))?;
    Ok(Some(Tccf { trigger, check, answer_block: req.tccf_answer_block_size.unwrap_or(TCCF_ANSWER_BLOCK) }))
}

/// The parameters among `names` that the request gives are an error unless `on` (the option they belong to,
/// `with`, is chosen): "x, y only apply with `with`".
fn only_with(req: &GenRequest, names: &[&'static str], on: bool, with: &str) -> Result<()> {
    let set = req.given(names);
    if on || set.is_empty() {
        return Ok(());
    }
    let verb = if set.len() == 1 { "applies" } else { "apply" };
    Err(Error::invalid(format!("{} only {verb} with {with}", set.join(", "))))
}
