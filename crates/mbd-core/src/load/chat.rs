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

/// `messages` with every content given as a list of parts (OpenAI's `[{"type": "text", "text": ...}, ...]`, which
/// the openai SDK's typed messages and LangChain's content blocks send) made one string, the text parts joined with
/// newlines; a part of another type (an image, audio, a file) is refused, naming it, as is a speaker's `name` outside
/// a tool message (no template here has a place for it). Borrowed when there is nothing to change.
pub fn text_messages(messages: &Value) -> Result<std::borrow::Cow<'_, Value>> {
    let Some(list) = messages.as_array() else { return Ok(std::borrow::Cow::Borrowed(messages)) };
    for (i, m) in list.iter().enumerate() {
        if m.get("name").is_some_and(|n| !n.is_null()) && m.get("role").and_then(Value::as_str) != Some("tool") {
            return Err(Error::invalid(format!(
                "messages[{i}].name is not supported: the chat template has no place for a speaker's name; leave it \
                 out (or put it in the content)"
            )));
        }
    }
    if !list.iter().any(|m| m.get("content").is_some_and(Value::is_array)) {
        return Ok(std::borrow::Cow::Borrowed(messages));
    }
    let mut out = list.clone();
    for (i, m) in out.iter_mut().enumerate() {
        let Some(Value::Array(parts)) = m.get("content") else { continue };
        let mut texts = Vec::with_capacity(parts.len());
        for (j, part) in parts.iter().enumerate() {
            let kind = part.get("type").and_then(Value::as_str);
            match (kind, part.get("text")) {
                (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
                (Some("text"), _) => {
                    return Err(Error::invalid(format!(
                        "messages[{i}].content[{j}] is a text part without a string 'text'"
                    )))
                }
                (Some(other), _) => {
                    let shown: String = other.chars().take(40).collect();
                    return Err(Error::invalid(format!(
                        "messages[{i}].content[{j}] is a {shown:?} part; this model reads text parts only"
                    )));
                }
                (None, _) => {
                    return Err(Error::invalid(format!(
                        "messages[{i}].content[{j}] must be a part like {{\"type\": \"text\", \"text\": ...}}, got {}",
                        crate::load::json::shown(part)
                    )))
                }
            }
        }
        m["content"] = Value::String(texts.join("\n"));
    }
    Ok(std::borrow::Cow::Owned(Value::Array(out)))
}

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

/// transformers' `tojson` filter, which chat templates use to write tools and tool calls: Python's `json.dumps` (keys
/// in their order, `ensure_ascii` off, separators `", "` and `": "`, or `","` and `": "` with an `indent`), not
/// minijinja's compact, HTML-escaped JSON.
fn tojson(
    v: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let value = serde_json::to_value(&v)
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let (item, key) = match separators.as_deref() {
        Some([i, k]) => (i.clone(), k.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, "tojson: separators is a pair"))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle { indent, ascii: ensure_ascii.unwrap_or(false), sort: sort_keys.unwrap_or(false), item, key };
    let mut out = String::new();
    style.write(&value, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

/// How Python's `json.dumps` lays a value out.
struct JsonStyle {
    indent: Option<usize>,
    ascii: bool,
    sort: bool,
    item: String,
    key: String,
}

impl JsonStyle {
    fn write(&self, v: &Value, depth: usize, out: &mut String) {
        match v {
            Value::Null => out.push_str("null"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => out.push_str(&n.to_string()),
            Value::String(s) => self.string(s, out),
            Value::Array(a) if a.is_empty() => out.push_str("[]"),
            Value::Object(o) if o.is_empty() => out.push_str("{}"),
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    self.gap(i > 0, depth + 1, out);
                    self.write(x, depth + 1, out);
                }
                self.gap(false, depth, out);
                out.push(']');
            }
            Value::Object(o) => {
                let mut items: Vec<(&String, &Value)> = o.iter().collect();
                if self.sort {
                    items.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in items.into_iter().enumerate() {
                    self.gap(i > 0, depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(x, depth + 1, out);
                }
                self.gap(false, depth, out);
                out.push('}');
            }
        }
    }

    /// Before an item (`sep`: not the first) or before a closing bracket: the item separator, then a new line at
    /// `depth` with an indent.
    fn gap(&self, sep: bool, depth: usize, out: &mut String) {
        if sep {
            out.push_str(&self.item);
        }
        if let Some(n) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ascii && (c as u32) > 0x7e) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// An assistant message's `tool_calls`: a list of {"id"?, "type"?: "function", "function": {"name", "arguments"}},
/// `arguments` a JSON object or its text (as OpenAI sends it).
fn check_tool_calls(i: usize, calls: &Value) -> Result<()> {
    let bad = |what: String| Error::invalid(format!("messages[{i}].tool_calls{what}"));
    let list =
        calls.as_array().ok_or_else(|| bad(format!(" must be a list, got {}", crate::load::json::shown(calls))))?;
    for (j, c) in list.iter().enumerate() {
        let f = c
            .get("function")
            .ok_or_else(|| bad(format!("[{j}] must have a 'function': {{\"name\", \"arguments\"}}")))?;
        if !f.get("name").is_some_and(Value::is_string) {
            return Err(bad(format!("[{j}].function.name must be a string")));
        }
        match f.get("arguments") {
            None | Some(Value::Object(_)) | Some(Value::String(_)) => {}
            Some(other) => {
                return Err(bad(format!(
                    "[{j}].function.arguments must be a JSON object or its text, got {}",
                    crate::load::json::shown(other)
                )))
            }
        }
        if c.get("type").is_some_and(|t| t.as_str() != Some("function")) {
            return Err(bad(format!("[{j}].type must be 'function'")));
        }
    }
    Ok(())
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
        env.add_filter("tojson", tojson);
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
            let role = m.get("role").and_then(Value::as_str);
            let calls = m.get("tool_calls").filter(|c| !c.is_null());
            // an assistant message that calls tools may have no content (OpenAI sends null)
            let content_ok = match m.get("content") {
                Some(Value::String(_)) => true,
                None | Some(Value::Null) => role == Some("assistant") && calls.is_some(),
                Some(_) => false,
            };
            if role.is_none() || !content_ok {
                return Err(Error::invalid(format!(
                    "messages[{i}] must have string 'role' and 'content' fields (content may be null in an \
                     assistant message with tool_calls), got {}",
                    crate::load::json::shown(m)
                )));
            }
            if let Some(c) = calls {
                check_tool_calls(i, c)?;
            }
            if let Some(id) = m.get("tool_call_id").filter(|v| !v.is_null() && !v.is_string()) {
                return Err(Error::invalid(format!(
                    "messages[{i}].tool_call_id must be a string, got {}",
                    crate::load::json::shown(id)
                )));
            }
            let role = role.unwrap_or_default();
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
