//! The attribute's arguments: `setup = path`, at most once.

use syn::parse::{Parse, ParseStream};
use syn::{ExprPath, Token};

mod kw {
    syn::custom_keyword!(setup);
}

/// What `#[idem_test::test(...)]` was given.
#[derive(Default)]
pub(crate) struct Args {
    /// The set-up fn, if any.
    pub(crate) setup: Option<ExprPath>,
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args::default();
        while !input.is_empty() {
            let lookahead = input.lookahead1();
            if lookahead.peek(kw::setup) {
                let key: kw::setup = input.parse()?;
                input.parse::<Token![=]>()?;
                let path: ExprPath = input.parse()?;
                if args.setup.is_some() {
                    return Err(syn::Error::new_spanned(key, "`setup` is given twice"));
                }
                args.setup = Some(path);
            } else {
                return Err(lookahead.error());
            }
            if !input.is_empty() {
                input.parse::<Token![,]>()?;
            }
        }
        Ok(args)
    }
}
