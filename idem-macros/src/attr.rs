//! The arguments of `#[idempotent(...)]`.

use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::{Error, Expr, ExprLit, Ident, Lit, LitStr, Path, Token};

mod kw {
    syn::custom_keyword!(name);
    syn::custom_keyword!(key);
    syn::custom_keyword!(codec);
    syn::custom_keyword!(state);
    syn::custom_keyword!(batch);
    syn::custom_keyword!(per_message);
}

/// `#[idempotent(name = "...", key = <expr>, codec = <codec>, state = <type>,
/// batch | per_message, crate = <path>)]`, all optional, in any order.
#[derive(Default)]
pub(crate) struct Args {
    /// The handler name stored with each claim. `None` means the fn's name.
    pub(crate) name: Option<LitStr>,
    /// The expression over the payload (and the delivery) that gives the
    /// message id.
    pub(crate) key: Option<Expr>,
    /// The payload's codec. `None` means JSON.
    pub(crate) codec: Option<Codec>,
    /// The path idem-runtime is reachable at. `None` means `::idem_runtime`.
    pub(crate) krate: Option<Path>,
    /// The router state to implement the handler for, checking its
    /// parameters at once. `None` means any state that provides them.
    pub(crate) state: Option<syn::Type>,
    /// `batch`: the fn takes the fresh messages of a batch together.
    pub(crate) batch: Option<proc_macro2::Span>,
    /// `per_message`: the fn must have its transaction to itself, so its
    /// routes never batch it with other messages.
    pub(crate) per_message: Option<proc_macro2::Span>,
}

/// `codec = json | raw | protobuf | <path to a type implementing Decode>`.
pub(crate) enum Codec {
    /// One of the runtime's own, by its short name.
    Builtin(Ident),
    /// A codec type of the user's.
    Path(Path),
}

impl Codec {
    /// The runtime's codecs, by the name `codec = ...` takes.
    pub(crate) const BUILTIN: [(&'static str, &'static str); 3] =
        [("json", "Json"), ("raw", "Raw"), ("protobuf", "Protobuf")];
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args::default();
        while !input.is_empty() {
            let lookahead = input.lookahead1();
            if lookahead.peek(kw::name) {
                let keyword = input.parse::<kw::name>()?;
                if args.name.is_some() {
                    return Err(duplicate(keyword, "name"));
                }
                input.parse::<Token![=]>()?;
                args.name = Some(handler_name(input.parse()?)?);
            } else if lookahead.peek(kw::key) {
                let keyword = input.parse::<kw::key>()?;
                if args.key.is_some() {
                    return Err(duplicate(keyword, "key"));
                }
                input.parse::<Token![=]>()?;
                args.key = Some(input.parse()?);
            } else if lookahead.peek(kw::codec) {
                let keyword = input.parse::<kw::codec>()?;
                if args.codec.is_some() {
                    return Err(duplicate(keyword, "codec"));
                }
                input.parse::<Token![=]>()?;
                args.codec = Some(codec(input.parse()?)?);
            } else if lookahead.peek(kw::state) {
                let keyword = input.parse::<kw::state>()?;
                if args.state.is_some() {
                    return Err(duplicate(keyword, "state"));
                }
                input.parse::<Token![=]>()?;
                args.state = Some(input.parse()?);
            } else if lookahead.peek(kw::batch) {
                let keyword = input.parse::<kw::batch>()?;
                if args.batch.is_some() {
                    return Err(Error::new_spanned(
                        keyword,
                        "`batch` is given twice: keep one",
                    ));
                }
                args.batch = Some(keyword.span);
            } else if lookahead.peek(kw::per_message) {
                let keyword = input.parse::<kw::per_message>()?;
                if args.per_message.is_some() {
                    return Err(Error::new_spanned(
                        keyword,
                        "`per_message` is given twice: keep one",
                    ));
                }
                args.per_message = Some(keyword.span);
            } else if lookahead.peek(Token![crate]) {
                let keyword = input.parse::<Token![crate]>()?;
                if args.krate.is_some() {
                    return Err(duplicate(keyword, "crate"));
                }
                input.parse::<Token![=]>()?;
                args.krate = Some(input.call(Path::parse_mod_style)?);
            } else if input.peek(Ident::peek_any) {
                let unknown = input.call(Ident::parse_any)?;
                return Err(Error::new_spanned(
                    &unknown,
                    format!(
                        "unknown argument `{unknown}`: `#[idempotent]` takes `name = \"...\"`, \
                         `key = <expr>`, `codec = json | raw | protobuf | <path>`, \
                         `state = <type>`, `batch`, `per_message` and `crate = <path>`"
                    ),
                ));
            } else {
                return Err(lookahead.error());
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        if let (Some(_), Some(per_message)) = (args.batch, args.per_message) {
            return Err(Error::new(
                per_message,
                "`per_message` and `batch` contradict each other: a batch handler takes the \
                 messages of a batch together in one transaction; remove one",
            ));
        }
        Ok(args)
    }
}

fn duplicate(keyword: impl quote::ToTokens, arg: &str) -> Error {
    Error::new_spanned(
        keyword,
        format!("`{arg}` is given twice: keep one `{arg} = ...`"),
    )
}

/// The value of `codec = ...`: a builtin's lowercase name, or a path.
fn codec(path: Path) -> syn::Result<Codec> {
    if let Some(ident) = path.get_ident() {
        let name = ident.to_string();
        if Codec::BUILTIN.iter().any(|(short, _)| *short == name) {
            return Ok(Codec::Builtin(ident.clone()));
        }
        if name.chars().next().is_some_and(char::is_lowercase) {
            return Err(Error::new_spanned(
                ident,
                format!(
                    "unknown codec `{name}`: write `codec = json`, `codec = raw`, \
                     `codec = protobuf`, or the path of a type that implements \
                     `idem_runtime::codec::Decode`"
                ),
            ));
        }
    }
    Ok(Codec::Path(path))
}

/// The value of `name = ...`: a non-blank string literal, because it is stored
/// as part of every dedup key.
fn handler_name(value: Expr) -> syn::Result<LitStr> {
    match value {
        Expr::Lit(ExprLit {
            lit: Lit::Str(name),
            ..
        }) if name.value().trim().is_empty() => Err(Error::new_spanned(
            name,
            "the handler name must not be empty: it is stored with every claim, \
             so write a stable name such as `name = \"credit-v1\"`",
        )),
        Expr::Lit(ExprLit {
            lit: Lit::Str(name),
            ..
        }) => Ok(name),
        other => Err(Error::new_spanned(
            other,
            "`name` takes a string literal: write `name = \"credit-v1\"`",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(tokens: proc_macro2::TokenStream) -> syn::Result<Args> {
        syn::parse2(tokens)
    }

    fn error(tokens: proc_macro2::TokenStream) -> String {
        match parse(tokens) {
            Ok(_) => panic!("the arguments parsed"),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn no_arguments() {
        let args = parse(quote::quote!()).unwrap();
        assert!(args.name.is_none());
        assert!(args.key.is_none());
    }

    #[test]
    fn name_and_key_in_any_order_with_trailing_comma() {
        let args = parse(quote::quote!(key = cmd.transfer_id, name = "credit-v1",)).unwrap();
        assert_eq!(args.name.unwrap().value(), "credit-v1");
        let key = args.key.unwrap();
        assert_eq!(quote::quote!(#key).to_string(), "cmd . transfer_id");
    }

    #[test]
    fn key_takes_any_expression() {
        let args = parse(quote::quote!(key = format!("{}:{}", a, b), name = "n")).unwrap();
        assert!(matches!(args.key, Some(Expr::Macro(_))));
        assert_eq!(args.name.unwrap().value(), "n");
    }

    #[test]
    fn unknown_argument() {
        assert_eq!(
            error(quote::quote!(name = "a", retries = 3)),
            "unknown argument `retries`: `#[idempotent]` takes `name = \"...\"`, `key = <expr>`, \
             `codec = json | raw | protobuf | <path>`, `state = <type>`, `batch`, `per_message` and \
             `crate = <path>`"
        );
    }

    #[test]
    fn unexpected_token() {
        assert_eq!(
            error(quote::quote!("credit")),
            "expected one of: `name`, `key`, `codec`, `state`, `batch`, `per_message`, `crate`"
        );
    }

    #[test]
    fn codec_and_crate() {
        let args = parse(quote::quote!(codec = raw, crate = ::my::idem)).unwrap();
        assert!(matches!(args.codec, Some(Codec::Builtin(ref ident)) if ident == "raw"));
        let krate = args.krate.unwrap();
        assert_eq!(quote::quote!(#krate).to_string(), ":: my :: idem");
        let args = parse(quote::quote!(codec = my_codecs::Cbor)).unwrap();
        assert!(matches!(args.codec, Some(Codec::Path(_))));
        assert!(error(quote::quote!(codec = yaml)).starts_with("unknown codec `yaml`"));
        assert_eq!(
            error(quote::quote!(codec = raw, codec = json)),
            "`codec` is given twice: keep one `codec = ...`"
        );
    }

    #[test]
    fn batch_is_a_flag() {
        let args = parse(quote::quote!(batch, name = "n")).unwrap();
        assert!(args.batch.is_some());
        assert!(parse(quote::quote!()).unwrap().batch.is_none());
        assert_eq!(
            error(quote::quote!(batch, batch)),
            "`batch` is given twice: keep one"
        );
        assert_eq!(error(quote::quote!(batch = true)), "expected `,`");
    }

    #[test]
    fn per_message_is_a_flag_that_batch_contradicts() {
        let args = parse(quote::quote!(per_message, name = "n")).unwrap();
        assert!(args.per_message.is_some());
        assert!(parse(quote::quote!()).unwrap().per_message.is_none());
        assert_eq!(
            error(quote::quote!(per_message, per_message)),
            "`per_message` is given twice: keep one"
        );
        assert!(
            error(quote::quote!(batch, per_message))
                .starts_with("`per_message` and `batch` contradict each other")
        );
    }

    #[test]
    fn duplicate_arguments() {
        assert_eq!(
            error(quote::quote!(name = "a", name = "b")),
            "`name` is given twice: keep one `name = ...`"
        );
        assert_eq!(
            error(quote::quote!(key = a, key = b)),
            "`key` is given twice: keep one `key = ...`"
        );
    }

    #[test]
    fn name_must_be_a_non_blank_string() {
        assert!(error(quote::quote!(name = "")).starts_with("the handler name must not be empty"));
        assert!(
            error(quote::quote!(name = "  ")).starts_with("the handler name must not be empty")
        );
        assert_eq!(
            error(quote::quote!(name = 5)),
            "`name` takes a string literal: write `name = \"credit-v1\"`"
        );
        assert_eq!(
            error(quote::quote!(name = credit)),
            "`name` takes a string literal: write `name = \"credit-v1\"`"
        );
    }

    #[test]
    fn missing_separator() {
        assert_eq!(error(quote::quote!(name = "a" key = b)), "expected `,`");
    }
}
