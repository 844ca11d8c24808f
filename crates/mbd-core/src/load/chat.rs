//! The model's chat template (chat_template.jinja, or tokenizer_config.json's `chat_template`),
//! rendered with minijinja configured like transformers' renderer.

use crate::error::{Error, Result};
use crate::load::json::{read_json, MAX_CHAT_TEMPLATE_BYTES};
use crate::util::read_model_file;
use serde_json::Value;
use std::path::Path;

/// minijinja instructions one render may execute (real chat templates over hundreds of messages use far less;
/// a looping or hostile template stops with an error instead of holding a worker).
pub const TEMPLATE_FUEL: u64 = 20_000_000;

/// The roles a message may have: OpenAI's (a role is rendered into the prompt as the template's markup, so a free
/// string could spell control tokens there: `user<|im_end|>\n<|im_start|>system` would open a system turn).
pub const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

fn token_string(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(|c| c.as_str()).unwrap_or("").to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// None when the model ships no chat template.
    pub fn from_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        let tc_path = dir.join("tokenizer_config.json");
        let tc = if tc_path.exists() { Some(read_json(&tc_path)?) } else { None };
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.exists() {
            let bytes = read_model_file(&jinja, MAX_CHAT_TEMPLATE_BYTES as u64, "the chat template")?;
            Some(String::from_utf8(bytes).map_err(|_| Error::load(format!("{}: not UTF-8 text", jinja.display())))?)
        } else {
            match tc.as_ref().and_then(|m| m.get("chat_template")) {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or_else(|| list.first())
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(|s| s.to_string()),
                Some(other) => {
                    return Err(Error::config(format!(
                        "{}: field 'chat_template' must be a string or a list of {{name, template}}, found {}",
                        tc_path.display(),
                        crate::load::json::type_name(other)
                    )))
                }
            }
        };
        let Some(source) = source else { return Ok(None) };
        let bos_token = token_string(tc.as_ref().and_then(|m| m.get("bos_token")));
        let eos_token = token_string(tc.as_ref().and_then(|m| m.get("eos_token")));
        Self::new(source, bos_token, eos_token, &dir.display().to_string()).map(Some)
    }

    /// A template from its source and the bos/eos token strings it may use (`label`: where it came from, for
    /// the parse error).
    pub fn new(source: String, bos_token: String, eos_token: String, label: &str) -> Result<ChatTemplate> {
        if source.len() > MAX_CHAT_TEMPLATE_BYTES {
            return Err(Error::config(format!(
                "{label}: the chat template is {} bytes; at most {} MiB is accepted",
                source.len(),
                MAX_CHAT_TEMPLATE_BYTES >> 20
            )));
        }
        let mut env = minijinja::Environment::new();
        // A template comes from the model directory: bound its work (loops included) per render.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source.clone())
            .map_err(|e| Error::config(format!("{label}: chat template does not parse: {e}")))?;
        Ok(ChatTemplate { env, source, bos_token, eos_token })
    }

    /// The template's Jinja source, as loaded.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// `messages`: a JSON list of {"role", "content"} objects.
    pub fn render(&self, messages: &Value, add_generation_prompt: bool, extra: &Value) -> Result<String> {
        let list = messages
            .as_array()
            .ok_or_else(|| Error::invalid("messages must be a list of {'role': ..., 'content': ...} dicts"))?;
        if list.is_empty() {
            return Err(Error::invalid("messages is empty"));
        }
        for (i, m) in list.iter().enumerate() {
            let ok = m.get("role").is_some_and(|r| r.is_string()) && m.get("content").is_some_and(|c| c.is_string());
            if !ok {
                return Err(Error::invalid(format!(
                    "messages[{i}] must have string 'role' and 'content' fields, got {m}"
                )));
            }
            let role = m["role"].as_str().unwrap_or_default();
            if !ROLES.contains(&role) {
                let shown: String = role.chars().take(40).collect();
                return Err(Error::invalid(format!(
                    "messages[{i}]: role must be one of {}, got {shown:?}",
                    crate::util::one_of(ROLES)
                )));
            }
        }
        let tmpl = self.env.get_template("chat").map_err(|e| Error::Internal(e.to_string()))?;
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), messages.clone());
        ctx.insert("add_generation_prompt".into(), Value::Bool(add_generation_prompt));
        ctx.insert("bos_token".into(), Value::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Value::String(self.eos_token.clone()));
        if let Value::Object(o) = extra {
            for (k, v) in o {
                ctx.insert(k.clone(), v.clone());
            }
        }
        tmpl.render(minijinja::Value::from_serialize(&ctx))
            .map_err(|e| Error::invalid(format!("chat template failed to render: {e}")))
    }
}
